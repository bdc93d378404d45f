"""Real Trainer runs inside a pool rank, and their comparison with one process: shared by the test modules.

:func:`lightning_env` is the one way a test makes a pool rank look launched to Lightning; :func:`fit_hf` fits a
tiny Hugging Face model under :class:`~lightning_longctx.UlyssesFPDTStrategy` and returns rank-local results;
:func:`compare_to_reference` checks them against a single-process loop on the same data, every parameter.
"""

from __future__ import annotations

import os

import lightning as L
import torch.distributed as dist

from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.integrations.transformers import context_of
from lightning_longctx.testing.hf_models import (
    HFModule,
    TokenDataset,
    checkpointing_state,
    reference_training,
    tiny_model,
)
from lightning_longctx.testing.ranks import rank_environment

SEQ = 24


def lightning_env() -> None:
    """Inside a :class:`~lightning_longctx.testing.DistPool` rank: torchrun's variables for this rank, so a
    Trainer takes the pool's processes as launched externally (LOCAL_RANK: it launches none) and uses the
    default group the pool initialised (the port is never dialled)."""
    port = int(os.environ.get("MASTER_PORT", "29500"))
    os.environ.update(rank_environment(dist.get_rank(), dist.get_world_size(), port))


def fit_hf(
    arch, sp, steps, strategy_kwargs, model_kwargs, accumulate=1, batch_size=1, trainer_kwargs=None, seq=SEQ
):
    lightning_env()
    world = dist.get_world_size()
    dp = world // sp
    data = TokenDataset(dp * batch_size * steps * accumulate, seq)
    module = HFModule(tiny_model(arch, **model_kwargs), batch_size=batch_size, dataset=data)
    strategy = (
        strategy_kwargs
        if isinstance(strategy_kwargs, str)
        else UlyssesFPDTStrategy(sequence_parallel_size=sp, **strategy_kwargs)
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(trainer_kwargs or {}),
    )
    checkpointing = checkpointing_state(module.model)
    trainer.fit(module)
    assert context_of(module.model) is None, "the strategy must hand the model back plain after fit"
    assert checkpointing_state(module.model) == checkpointing, "checkpointing must be as it came, too"
    # through the strategy: full tensors also when the parameters are FSDP2-sharded (a collective)
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, module.losses, trainer.strategy.sp_size


def compare_to_reference(
    results, arch, sp, world, steps, model_kwargs, accumulate=1, batch_size=1, seq=SEQ, clip=None
):
    dp = world // sp
    ref_model = tiny_model(arch, **model_kwargs)
    data = TokenDataset(dp * batch_size * steps * accumulate, seq)
    ref_losses = reference_training(
        ref_model, data, dp=dp, batch_size=batch_size, steps=steps, accumulate=accumulate, clip=clip
    )
    ref_state = ref_model.state_dict()
    init_state = tiny_model(arch, **model_kwargs).state_dict()
    worst = 0.0
    assert results[0][0], "rank 0 must hold the full state dict"
    for state, _losses, got_sp in results:
        assert got_sp == sp
        if not state:  # FSDP: full state dicts are gathered on rank 0 only (CPU offload)
            continue
        for name, ref in ref_state.items():
            moved = (ref - init_state[name]).abs().max().item()
            err = (state[name] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            assert moved > 0 or "bias" in name, f"{name} never changed: the test would prove nothing"
            assert err < 1e-5, f"{name}: relative error {err:.2e}"
            worst = max(worst, err)
    rank0_losses = results[0][1]
    if accumulate == 1 and dp == 1:
        assert max(abs(a - b) for a, b in zip(rank0_losses, ref_losses)) < 1e-5
    return worst
