"""Real Trainer runs under UlyssesFPDTStrategy on gloo vs a single-process loop: every parameter."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import HFModule, TokenDataset, reference_training, tiny_model
from helpers.lightning import SEQ, compare_to_reference, fit_hf, lightning_env
from lightning_longctx import UlyssesFPDTStrategy

CASES = {
    # name: (arch, world, sp, strategy kwargs, model kwargs, accumulate)
    "llama_sp2": ("llama", 2, 2, {}, {}, 1),
    "qwen2_sp2": ("qwen2", 2, 2, {}, {}, 1),
    "mistral_sp4": ("mistral", 4, 4, {}, {}, 1),
    "llama_gqa_kv1_sp4": ("llama", 4, 4, {}, {"kv_heads": 1}, 1),
    "llama_dp2_sp2": ("llama", 4, 2, {}, {}, 1),
    "llama_sp2_accumulate2": ("llama", 2, 2, {}, {}, 2),
    "llama_fsdp_dp2_sp2": ("llama", 4, 2, {"data_parallel": "fsdp"}, {}, 1),
    "qwen2_fsdp_sp2_fpdt_accumulate2": (
        "qwen2",
        2,
        2,
        {"data_parallel": "fsdp", "fpdt_chunk_size": 4},
        {},
        2,
    ),
    "llama_sp2_activation_checkpointing": ("llama", 2, 2, {"activation_checkpointing": True}, {}, 1),
    # activation offload (checkpointed layer inputs in host memory), alone and with FPDT offload and FSDP
    "llama_sp1_activation_offload": ("llama", 1, 1, {"activation_offload": True}, {}, 1),
    "llama_sp2_activation_offload": ("llama", 2, 2, {"activation_offload": True}, {}, 1),
    "qwen2_fpdt_sp4_offload_activation_offload": (
        "qwen2",
        4,
        4,
        {"fpdt_chunk_size": 2, "offload": True, "activation_offload": True},
        {"kv_heads": 1},
        1,
    ),
    "llama_fsdp_dp2_sp2_fpdt_activation_offload": (
        "llama",
        4,
        2,
        {"data_parallel": "fsdp", "fpdt_chunk_size": 4, "offload": True, "activation_offload": True},
        {},
        1,
    ),
    # FPDT: 24 tokens, sp 2 -> 12 local tokens in 3 chunks of 4; tiled MLP + chunked loss; offload
    "llama_fpdt_sp2_offload": ("llama", 2, 2, {"fpdt_chunk_size": 4, "offload": True}, {}, 1),
    "qwen2_fpdt_sp4_gqa_kv1": ("qwen2", 4, 4, {"fpdt_chunk_size": 2}, {"kv_heads": 1}, 1),
    "llama_fpdt_dp2_sp2_accumulate2": ("llama", 4, 2, {"fpdt_chunk_size": 4, "offload": True}, {}, 2),
    # a hybrid (Qwen3.5: causal conv k=4 + gated DeltaNet layer, attention layer): halo and state passing
    "qwen3_5_sp2": ("qwen3_5", 2, 2, {}, {}, 1),
    "qwen3_5_fpdt_sp2_accumulate2": ("qwen3_5", 2, 2, {"fpdt_chunk_size": 4}, {}, 2),
    "bamba_dp2_sp2": ("bamba", 4, 2, {}, {}, 1),  # Mamba-2 SSD + attention, DDP over dp x sp
    "qwen3_5_sp4": ("qwen3_5", 4, 4, {}, {}, 1),
    "qwen3_5_fpdt_sp4_offload": ("qwen3_5", 4, 4, {"fpdt_chunk_size": 3, "offload": True}, {}, 1),
    "qwen3_5_fpdt_dp2_sp2_checkpointing": (
        "qwen3_5",
        4,
        2,
        {"fpdt_chunk_size": 4, "activation_checkpointing": True},
        {},
        1,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_match_single_process(dist_pool, name):
    arch, world, sp, skw, mkw, acc = CASES[name]
    steps = 2
    results = dist_pool(world).run(fit_hf, arch, sp, steps, skw, mkw, acc)
    compare_to_reference(results, arch, sp, world, steps, mkw, accumulate=acc)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_not_divisible_is_padded_exactly(dist_pool, world):
    """23 tokens over 2 or 4 ranks, batch 2: padded at the end, loss and every parameter unchanged."""
    results = dist_pool(world).run(fit_hf, "llama", world, 2, {}, {}, 1, 2, None, 23)
    compare_to_reference(results, "llama", world, world, 2, {}, batch_size=2, seq=23)


@pytest.mark.parametrize("fpdt", [False, True])
def test_gradient_clipping_matches(dist_pool, fpdt):
    """Clipping acts on the reduced (full) gradient: clip_grad_norm_ of a single-process loop."""
    skw = {"fpdt_chunk_size": 4} if fpdt else {}
    clip = {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}
    results = dist_pool(2).run(fit_hf, "llama", 2, 2, skw, {}, 1, 1, clip)
    compare_to_reference(results, "llama", 2, 2, 2, {}, clip=0.05)


def test_sp1_single_process_matches(dist_pool):
    results = dist_pool(1).run(fit_hf, "llama", 1, 2, {}, {})
    compare_to_reference(results, "llama", 1, 1, 2, {})


def test_registered_name_works(dist_pool):
    results = dist_pool(2).run(fit_hf, "llama", 2, 2, "ulysses", {})
    compare_to_reference(results, "llama", 2, 2, 2, {})


def _bad_sp():
    try:
        fit_hf("llama", 3, 1, {}, {})
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def test_sp_not_dividing_world_fails_naming_both(dist_pool):
    for msg in dist_pool(2).run(_bad_sp):
        assert "sequence_parallel_size=3" in msg and "world size 2" in msg


def test_registry_and_config_errors():
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_longctx

    lightning_longctx.UlyssesFPDTStrategy.register_strategies(StrategyRegistry)  # idempotent
    for name in ("ulysses_fpdt", "ulysses", "fpdt_offload"):
        assert StrategyRegistry[name]["strategy"] is UlyssesFPDTStrategy
    assert StrategyRegistry["fpdt_offload"]["init_params"]["offload"] is True
    with pytest.raises(ValueError, match="offload=True needs FPDT chunking"):
        UlyssesFPDTStrategy(offload=True)
    with pytest.raises(ValueError, match="data_parallel='zero3' is unknown"):
        UlyssesFPDTStrategy(data_parallel="zero3")
    with pytest.raises(ValueError, match="sequence_parallel_size=0"):
        UlyssesFPDTStrategy(sequence_parallel_size=0)
    with pytest.raises(
        ValueError, match=r"mlp_chunk_size=0: use None \(the default\) or a positive token count"
    ):
        UlyssesFPDTStrategy(fpdt_chunk_size=8, mlp_chunk_size=0)
    with pytest.raises(ValueError, match="loss_chunk_size=-1"):
        UlyssesFPDTStrategy(loss_chunk_size=-1)


def test_settings_are_written_once_and_seen_by_the_cli():
    """SequenceParallelConfig is the one source: the strategy's signature and docs are derived from it."""
    import dataclasses
    import inspect

    from lightning_longctx.lightning.strategy import SequenceParallelConfig

    params = inspect.signature(UlyssesFPDTStrategy).parameters
    for field in dataclasses.fields(SequenceParallelConfig):
        assert params[field.name].default == field.default, field.name
        assert f"{field.name}: " in UlyssesFPDTStrategy.__doc__, f"{field.name} undocumented"
    assert "{config_args}" not in UlyssesFPDTStrategy.__doc__
    strategy = UlyssesFPDTStrategy(fpdt_chunk_size=8, pad_token_id=3, find_unused_parameters=True)
    assert strategy.sp_config == SequenceParallelConfig(fpdt_chunk_size=8, pad_token_id=3)
    # the rest goes to DDP; gradients live in its buckets by default
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}


# ---- guardrails ----


def _fit_module(module, sp, steps=1, ckpt_path=None, data_parallel="ddp", self_test="auto", **trainer_kwargs):
    lightning_env()
    kwargs = dict(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    kwargs.update(trainer_kwargs)
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(
            sequence_parallel_size=sp, data_parallel=data_parallel, self_test=self_test
        ),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=steps,
        **kwargs,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def _expect_error(build, self_test="auto"):
    try:
        _fit_module(build(), 2, self_test=self_test)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "NO ERROR"


def _bloom_module():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    return HFModule(model, dataset=TokenDataset(2, SEQ))


def _one_layer_bypasses_swap():
    import types

    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        # a model that hard-codes its own attention: it silently attends only to the local shard
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = modeling_llama.apply_rotary_pos_emb(q, k, *position_embeddings)
        out, _ = modeling_llama.eager_attention_forward(self, q, k, v, None, scaling=self.scaling)
        return self.o_proj(out.reshape(b, s, -1)), None

    attn.forward = types.MethodType(forward, attn)
    return HFModule(model, dataset=TokenDataset(2, SEQ))


class _IterModule(HFModule):
    def training_step(self, dataloader_iter):
        batch = next(dataloader_iter)
        return self.model(**batch).loss


def _dataloader_iter_module():
    return _IterModule(tiny_model("llama"), dataset=TokenDataset(2, SEQ))


@pytest.mark.parametrize(
    "build,self_test,expected",
    [
        (_bloom_module, "auto", "does not route attention through transformers' AttentionInterface"),
        # two nets: the self-test names the layer before the first step; without it, the first step's count
        (_one_layer_bypasses_swap, "auto", "): model.layers.1.self_attn (its inputs agree"),
        (
            _one_layer_bypasses_swap,
            False,
            "only 1 of 2 attention layers went through sequence-parallel attention",
        ),
        (_dataloader_iter_module, "auto", "training_step(dataloader_iter) bypasses it"),
    ],
    ids=["bloom", "layer_bypasses_swap", "layer_bypasses_swap_no_self_test", "dataloader_iter"],
)
def test_guardrails_refuse_silent_no_ops(dist_pool, build, self_test, expected):
    for msg in dist_pool(2).run(_expect_error, build, self_test):
        assert expected in msg, msg


# ---- checkpoints ----


def _resume(root, data_parallel, adam):
    from lightning.pytorch.callbacks import ModelCheckpoint

    steps = 4
    data = TokenDataset(2, SEQ)  # two epochs of two steps; the checkpoint sits at the epoch boundary
    full = HFModule(tiny_model("llama"), dataset=data, adam=adam)
    full_state = _fit_module(full, 2, steps=steps, data_parallel=data_parallel).strategy.full_state_dict()

    first = HFModule(tiny_model("llama"), dataset=data, adam=adam)
    ckpt = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
    _fit_module(first, 2, steps=2, data_parallel=data_parallel, callbacks=[ckpt], enable_checkpointing=True)
    dist.barrier()
    second = HFModule(tiny_model("llama", seed=123), dataset=data, adam=adam)  # must be overwritten
    trainer = _fit_module(
        second, 2, steps=steps, data_parallel=data_parallel, ckpt_path=f"{root}/epoch=0-step=2.ckpt"
    )
    return (
        full.losses,
        first.losses + second.losses,
        full_state,
        trainer.strategy.full_state_dict(),
    )


@pytest.mark.parametrize("data_parallel,adam", [("ddp", False), ("fsdp", False), ("fsdp", True)])
def test_checkpoint_resume_continues_exactly(dist_pool, tmp_path, data_parallel, adam):
    results = dist_pool(2).run(_resume, str(tmp_path), data_parallel, adam)
    assert results[0][2] and results[0][3]
    for full_losses, resumed_losses, full_state, resumed_state in results:
        assert len(resumed_losses) == len(full_losses) == 4
        assert max(abs(a - b) for a, b in zip(full_losses, resumed_losses)) < 1e-6
        for name, ref in full_state.items():
            assert torch.allclose(resumed_state[name], ref, rtol=1e-6, atol=1e-7), name


def test_exported_state_dict_loads_into_plain_hf_model(dist_pool):
    results = dist_pool(2).run(fit_hf, "llama", 2, 2, {}, {})
    state = results[0][0]
    plain = tiny_model("llama", seed=7)
    plain.load_state_dict(state, strict=True)  # same keys: the swap never renamed a parameter
    assert plain.config._attn_implementation in ("sdpa", "eager")
    ref = tiny_model("llama")
    data = TokenDataset(2, SEQ)
    reference_training(ref, data, dp=1, batch_size=1, steps=2)
    batch = {k: torch.stack([data[0][k]]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        assert abs(plain(**batch).loss.item() - ref(**batch).loss.item()) < 1e-5


class _RankDependentLength(TokenDataset):
    """Rank 1 reads longer sequences than rank 0: a config that differs across ranks."""

    def __init__(self) -> None:
        super().__init__(2, SEQ + 4 * dist.get_rank())


def _mismatched_lengths_module():
    return HFModule(tiny_model("llama"), dataset=_RankDependentLength())


def _unsupported_precision():
    from lightning.pytorch.plugins.precision import Precision

    class FP8(Precision):
        precision = "transformer-engine"

    lightning_env()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=2),
        plugins=[FP8()],
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
    )
    try:
        trainer.fit(HFModule(tiny_model("llama"), dataset=TokenDataset(2, SEQ)))
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def test_lengths_differing_across_ranks_fail_before_a_collective_hangs(dist_pool):
    for msg in dist_pool(2).run(_expect_error, _mismatched_lengths_module):
        assert "shapes differ across ranks: {0: (1, 24), 1: (1, 28)}" in msg, msg


def test_unsupported_precision_is_refused(dist_pool):
    for msg in dist_pool(2).run(_unsupported_precision):
        assert "precision='transformer-engine' is not supported" in msg, msg


def test_unknown_and_ignored_settings_are_refused():
    """A typo, another strategy's setting or a DDP keyword FSDP would ignore: a TypeError naming it and the fix,
    never a run that silently leaves the feature off."""
    with pytest.raises(
        TypeError, match="unknown setting 'activation_ofload'; did you mean 'activation_offload'"
    ):
        UlyssesFPDTStrategy(data_parallel="fsdp", activation_ofload=True)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=2 with data_parallel='ddp'.*data_parallel='fsdp'"
    ):
        UlyssesFPDTStrategy(tensor_parallel_size=2)
    with pytest.raises(TypeError, match=r"find_unused_parameters=True configures DDP.*data_parallel='fsdp'"):
        UlyssesFPDTStrategy(data_parallel="fsdp", find_unused_parameters=True)
    with pytest.raises(TypeError, match=r"ddp_comm_hook=.* configures DDP"):
        UlyssesFPDTStrategy(data_parallel="fsdp", ddp_comm_hook=print)
    with pytest.raises(TypeError, match="gradient_as_bucket_view=False configures DDP"):
        UlyssesFPDTStrategy(data_parallel="fsdp", gradient_as_bucket_view=False)
    with pytest.raises(TypeError, match="sets DistributedDataParallel's 'device_ids' itself"):
        UlyssesFPDTStrategy(device_ids=[0])
    with pytest.raises(TypeError, match=r"model_averaging_period .*post-local SGD.* not supported"):
        UlyssesFPDTStrategy(model_averaging_period=4)
    # DDP keywords at their defaults (LightningCLI passes every one of them) and the Strategy's own pass
    fsdp = UlyssesFPDTStrategy(
        data_parallel="fsdp", find_unused_parameters=False, process_group=None, start_method="spawn"
    )
    assert "gradient_as_bucket_view" not in fsdp._ddp_kwargs
    ddp = UlyssesFPDTStrategy(gradient_as_bucket_view=False, static_graph=True)
    assert ddp._ddp_kwargs == {"gradient_as_bucket_view": False, "static_graph": True}
    # the ones the strategy sets itself, at their defaults, are not passed on (DDP would get them twice)
    ddp = UlyssesFPDTStrategy(process_group=None, device_ids=None, output_device=None, device_mesh=None)
    assert ddp._ddp_kwargs == {"gradient_as_bucket_view": True}
