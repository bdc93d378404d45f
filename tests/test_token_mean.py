"""The loss of a step = one device's loss on the whole global batch: the token mean over all dp ranks and
all micro-batches of the accumulation window (loss_normalization="tokens", the default)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from helpers.hf_models import HFModule, reference_training, tiny_config, tiny_model
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.parallel.sharding import shift_labels

SEQ, LR = 24, 0.5


class SFTDataset(Dataset):
    """Random tokens whose prompts (labels -100) have a different length per sample; ``empty`` lists
    samples with no target at all."""

    def __init__(self, n: int, seq: int = SEQ, vocab: int = 64, empty: tuple[int, ...] = ()) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.labels = self.ids.clone()
        for i, p in enumerate(torch.randint(1, seq - 1, (n,), generator=g).tolist()):
            self.labels[i, :p] = -100
        for i in empty:
            self.labels[i] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _global_batches(dataset, *, dp: int, batch_size: int, steps: int, accumulate: int) -> list[list[dict]]:
    """Per step, the micro-batches of all dp ranks in Lightning's DistributedSampler order (seed 0)."""
    orders = [
        list(DistributedSampler(dataset, num_replicas=dp, rank=j, shuffle=True, seed=0)) for j in range(dp)
    ]
    out = []
    for step in range(steps):
        window = []
        for micro in range(accumulate):
            first = (step * accumulate + micro) * batch_size
            for j in range(dp):
                idx = orders[j][first : first + batch_size]
                window.append({k: torch.stack([dataset[i][k] for i in idx]) for k in ("input_ids", "labels")})
        out.append(window)
    return out


def reference_token_mean(model, optimizer, windows, *, clip: float | None = None) -> list[float]:
    """One device on each global batch: sum of every token loss / number of valid tokens, then step."""
    losses = []
    for window in windows:
        optimizer.zero_grad()
        targets = [shift_labels(b["labels"]) for b in window]
        count = max(sum(int((t != -100).sum()) for t in targets), 1)
        total = 0.0
        for batch, target in zip(window, targets):
            logits = model(input_ids=batch["input_ids"]).logits
            token_sum = F.cross_entropy(
                logits.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum"
            )
            (token_sum / count).backward()
            total += token_sum.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(total / count)
    return losses


class _StepLosses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.strategy.step_loss is not None:
            self.losses.append(float(trainer.strategy.step_loss))


def _fit(sp, steps, accumulate, strategy_kwargs, clip, empty, batch_size=1):
    lightning_env()
    dp = dist.get_world_size() // sp
    data = SFTDataset(dp * batch_size * steps * accumulate, empty=empty)
    module = HFModule(tiny_model("llama"), lr=LR, batch_size=batch_size, dataset=data)
    spy = _StepLosses()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp, **strategy_kwargs),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[spy],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, spy.losses


def _max_rel_error(state: dict, ref: torch.nn.Module) -> float:
    worst = 0.0
    init = tiny_model("llama").state_dict()
    for name, value in ref.state_dict().items():
        assert (value - init[name]).abs().max() > 0, f"{name} never moved: the test would prove nothing"
        worst = max(worst, ((state[name] - value).abs().max() / value.abs().max()).item())
    return worst


CASES = {
    # name: (world, sp, accumulate, strategy kwargs, clip, empty samples)
    "sp1_accumulate4": (1, 1, 4, {}, None, ()),
    "sp2_accumulate2_clip": (2, 2, 2, {}, 0.05, ()),
    "sp4_accumulate2_fpdt": (4, 4, 2, {"fpdt_chunk_size": 2}, None, ()),
    "dp2_sp2_accumulate1": (4, 2, 1, {}, None, ()),
    "dp2_sp2_accumulate2_fpdt_clip": (4, 2, 2, {"fpdt_chunk_size": 4}, 0.05, ()),
    "dp2_sp2_accumulate4_fsdp": (4, 2, 4, {"data_parallel": "fsdp"}, None, ()),
    "dp2_sp2_accumulate2_fsdp_fpdt_clip": (
        4,
        2,
        2,
        {"data_parallel": "fsdp", "fpdt_chunk_size": 4},
        0.05,
        (),
    ),
    "sp2_accumulate2_empty_micro_batch": (2, 2, 2, {}, None, (0, 5)),
}
STEPS = 3


@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_one_device_on_the_global_batch(dist_pool, name):
    world, sp, accumulate, kwargs, clip, empty = CASES[name]
    results = dist_pool(world).run(_fit, sp, STEPS, accumulate, kwargs, clip, empty)
    dp = world // sp
    data = SFTDataset(dp * STEPS * accumulate, empty=empty)
    windows = _global_batches(data, dp=dp, batch_size=1, steps=STEPS, accumulate=accumulate)
    ref = tiny_model("llama")
    ref_losses = reference_token_mean(ref, torch.optim.SGD(ref.parameters(), lr=LR), windows, clip=clip)
    assert all(torch.isfinite(torch.tensor(r[1])).all() for r in results)
    for state, losses in results:
        assert losses == results[0][1], "train loss differs across ranks"
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
        if state:  # FSDP gathers the full state dict on rank 0 only
            err = _max_rel_error(state, ref)
            assert err < 1e-5, f"{name}: relative error {err:.2e}"


def test_micro_batch_switch_keeps_lightning_mean_and_differs_from_token_mean(dist_pool):
    """loss_normalization='micro_batch' is Lightning's mean of per-micro-batch means (dp 2 x sp 2, k = 2);
    on these SFT labels it is measurably not the token mean, so the tests above prove something."""
    results = dist_pool(4).run(_fit, 2, STEPS, 2, {"loss_normalization": "micro_batch"}, None, ())
    data = SFTDataset(2 * STEPS * 2)
    means = tiny_model("llama")
    reference_training(means, data, dp=2, batch_size=1, steps=STEPS, accumulate=2, lr=LR)
    assert _max_rel_error(results[0][0], means) < 1e-5
    assert results[0][1] == []  # no token-mean step loss in this mode
    tokens = tiny_model("llama")
    windows = _global_batches(data, dp=2, batch_size=1, steps=STEPS, accumulate=2)
    reference_token_mean(tokens, torch.optim.SGD(tokens.parameters(), lr=LR), windows)
    init = tiny_model("llama").state_dict()
    update_gap = max(
        (
            (means.state_dict()[n] - tokens.state_dict()[n]).norm()
            / (tokens.state_dict()[n] - init[n]).norm()
        ).item()
        for n in init
    )
    assert update_gap > 0.1, f"mean of means vs token mean differ by only {update_gap:.3f} of the update"


def _fit_causal_lm(accumulate: int) -> dict:
    from lightning_longctx.recipes import CausalLM

    lightning_env()
    cfg = tiny_config("llama").to_dict()
    config = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    config.update(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    module = CausalLM(model_config=config, lr=1e-2, eval_metric=False)
    module.configure_model()
    init = {k: v.clone() for k, v in module.hf_model.state_dict().items()}
    logged: list[float] = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate == 0:
                logged.append(float(trainer.callback_metrics["train/loss"]))

    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=2, fpdt_chunk_size=4),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=[Spy()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = SFTDataset(2 * STEPS * accumulate)
    trainer.fit(module, DataLoader(data, batch_size=1))
    return {"init": init, "config": config, "logged": logged}


def test_causal_lm_logs_the_token_weighted_step_loss_on_every_rank(dist_pool):
    """CausalLM under dp 2 x sp 2 (FPDT), accumulate 2: `train/loss` is the step's token mean, equal on
    every rank and equal to one device's loss on the global batch (AdamW, same hyper-parameters)."""
    from lightning_longctx.recipes import CausalLM

    results = dist_pool(4).run(_fit_causal_lm, 2)
    ref = CausalLM(model_config=results[0]["config"], lr=1e-2, eval_metric=False)
    ref.configure_model()
    ref.hf_model.load_state_dict(results[0]["init"])
    windows = _global_batches(SFTDataset(2 * STEPS * 2), dp=2, batch_size=1, steps=STEPS, accumulate=2)
    ref_losses = reference_token_mean(ref.hf_model, ref.configure_optimizers(), windows)
    for r in results:
        assert len(r["logged"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["logged"], ref_losses)) < 1e-5, (r["logged"], ref_losses)


def _no_labels_message() -> str:
    class NoLabels(HFModule):
        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"]).logits.mean()

    class Ids(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": torch.arange(1, SEQ + 1) % 60}

    lightning_env()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=2),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(NoLabels(tiny_model("llama"), dataset=Ids()))
    except ValueError as e:
        return str(e)
    return "NO ERROR"


def test_batch_without_labels_is_refused_with_the_switch_named(dist_pool):
    for msg in dist_pool(2).run(_no_labels_message):
        assert "counts the valid targets" in msg and "loss_normalization='micro_batch'" in msg, msg
