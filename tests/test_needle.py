"""NeedleRetrieval: the needle grid's per-cell exact match, the answer tokens' logits and loss equal one process's.

Reference: the plain model on each whole prompt in float32, logits at the answer's positions. The prompts end,
for two of three samples, with the reference model's own greedy answer (retrieved by construction) and otherwise
with a random key (almost never retrieved), so the cells hold 0, 0.5 and 1. A forward hook
on the model records, on every rank, the rows its lm_head projected: only the answer positions that rank holds.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from helpers.hf_models import HFModule, TokenDataset, tiny_model
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.data import ByteTokenizer
from lightning_longctx.lightning.callbacks import NeedleRetrieval
from lightning_longctx.lightning.callbacks.needle import (
    METRIC_PREFIX,
    NeedlePrompt,
    NeedleSample,
    PasskeyPrompt,
)

LENGTHS = (30, 64)  # 30: shard_batch pads the end at P = 4 (and P x chunk): the answer sits before the pads
DEPTHS = (0.0, 0.5, 1.0)
SAMPLES = 2
VOCAB = ByteTokenizer.vocab_size
TOL = 1e-5
PNG = b"\x89PNG\r\n\x1a\n"


class _GreedyPrompt(NeedlePrompt):
    """Short passkey prompts; two of three end with the reference model's greedy answer (a model of its own,
    the same weights as the one under test: built alike on every rank), by cell and sample."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.base = PasskeyPrompt(
            ByteTokenizer(), "ab. cd. ef.", needle="k{key}.", question="k?", task="", key_digits=2
        )
        self.model = tiny_model("llama", vocab=VOCAB).eval()

    def sample(self, length: int, depth: float, index: int) -> NeedleSample:
        s = self.base.sample(length, depth, index)
        if (length + round(4 * depth) + index) % 3 == 0:
            return s
        ids = s.input_ids.clone()
        with torch.no_grad():
            for t in range(length - s.answer_len, length):  # teacher forced on its own greedy tokens
                ids[t] = self.model(ids[None, :t]).logits[0, -1].argmax()
        return NeedleSample(ids, s.answer_len, s.needle_at)


class _ValModule(HFModule):
    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val/loss", loss, sync_dist=True, batch_size=batch["input_ids"].shape[0])
        return loss


def _cells() -> list[tuple[int, float]]:
    return [(n, d) for n in LENGTHS for d in DEPTHS]


def _reference() -> dict:
    """Per cell: the fraction retrieved and the answer tokens' mean loss; per (cell, sample, position): the
    logits row predicting the answer token after ``position``."""
    model, prompt = tiny_model("llama", vocab=VOCAB).eval(), _GreedyPrompt()
    accuracy, loss, rows = {}, {}, {}
    with torch.no_grad():
        for c, (n, d) in enumerate(_cells()):
            hits, total, count = 0, 0.0, 0
            for i in range(SAMPLES):
                s = prompt.sample(n, d, i)
                assert s.input_ids.shape == (n,)
                logits = model(s.input_ids[None]).logits[0]
                at = range(n - s.answer_len - 1, n - 1)
                target = s.input_ids[n - s.answer_len :]
                hits += bool((logits[list(at)].argmax(-1) == target).all())
                total += float(F.cross_entropy(logits[list(at)].double(), target, reduction="sum"))
                count += s.answer_len
                rows.update({(c, i, t): logits[t] for t in at})
            accuracy[(n, d)] = hits / SAMPLES
            loss[(n, d)] = total / count
    return {"accuracy": accuracy, "loss": loss, "rows": rows}


def _recording(model: torch.nn.Module) -> list:
    """Every forward with a boolean ``logits_to_keep``: (sample of each row, its global position, the rows)."""
    seen = []

    def hook(module, args, kwargs, output):
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, torch.Tensor) and keep.dtype == torch.bool:
            pos = kwargs.get("position_ids")
            pos = torch.arange(keep.shape[1]).expand_as(keep) if pos is None else pos.expand_as(keep)
            seen.append((keep.nonzero()[:, 0], pos[keep], output.logits.detach().clone()))

    model.register_forward_hook(hook, with_kwargs=True)
    return seen


def _logged(trainer: L.Trainer) -> dict[str, float]:
    return {
        k.removeprefix(METRIC_PREFIX): float(v)
        for k, v in trainer.callback_metrics.items()
        if k.startswith(METRIC_PREFIX)
    }


def _validate(trainer_kwargs: dict, root: str) -> dict:
    callback = NeedleRetrieval(LENGTHS, DEPTHS, samples=SAMPLES, batch_size=SAMPLES, prompt=_GreedyPrompt())
    module = _ValModule(tiny_model("llama", vocab=VOCAB))
    seen = _recording(module.model)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        default_root_dir=root,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.validate(module, DataLoader(TokenDataset(2, 32), batch_size=1), verbose=False)
    strategy = trainer.strategy
    return {
        "run": callback.history[-1],
        "logged": _logged(trainer),
        "seen": seen,
        "dp": (getattr(strategy, "dp_rank", 0), getattr(strategy, "dp_size", 1)),
        "plot": callback.plot_path,
        "table": callback.table(),
    }


def _validate_on_rank(sp: int, chunk: int | None, root: str) -> dict:
    lightning_env()
    extra = {} if chunk is None else {"fpdt_chunk_size": chunk}
    strategy = UlyssesFPDTStrategy(sequence_parallel_size=sp, **extra)
    return _validate({"strategy": strategy, "devices": dist.get_world_size()}, root)


def _check(results: list[dict]) -> tuple[float, float]:
    """``(max error of the answer logits, of the cells' losses)`` vs one process; asserts the rest exactly."""
    ref = _reference()
    values = set(ref["accuracy"].values())
    assert len(values) > 1, f"the reference cells are all {values}: the comparison would prove little"
    logit_err = loss_err = 0.0
    for out in results:
        assert out["run"]["accuracy"] == ref["accuracy"], (out["run"]["accuracy"], ref["accuracy"])
        loss_err = max(loss_err, *(abs(out["run"]["loss"][c] - v) for c, v in ref["loss"].items()))
        want = {f"{n}/{d:g}": v for (n, d), v in ref["accuracy"].items()}
        want["mean"] = sum(ref["accuracy"].values()) / len(ref["accuracy"])
        assert {k: v for k, v in out["logged"].items() if k != "loss"} == pytest.approx(want, abs=1e-7)
    # the answer's logits: the rows every rank's lm_head projected, each answer position once, nothing else
    by_forward: dict[tuple[int, int], list] = {}
    for out in results:
        rank, size = out["dp"]
        for j, (samples, positions, logits) in enumerate(out["seen"]):
            cell = rank + j * size  # batches[rank::size]; one batch per cell (batch_size = samples)
            by_forward.setdefault((cell, rank), []).append((samples, positions, logits))
    covered = set()
    for (cell, _), parts in by_forward.items():
        if cell >= len(_cells()):
            continue  # a data-parallel rank's padding forward: not counted
        got = {}
        for samples, positions, logits in parts:
            assert logits.shape == (len(positions), VOCAB)
            for b, t, row in zip(samples.tolist(), positions.tolist(), logits):
                assert (cell, b, t) not in got, f"position {t} projected by two ranks"
                got[(cell, b, t)] = row
        want = {k: v for k, v in ref["rows"].items() if k[0] == cell}
        assert set(got) == set(want), f"cell {cell}: projected {sorted(got)}, the answer is at {sorted(want)}"
        logit_err = max(logit_err, *(float((got[k] - v).abs().max()) for k, v in want.items()))
        covered.add(cell)
    assert covered == set(range(len(_cells())))
    assert logit_err < TOL and loss_err < TOL, (
        f"max error vs one process: logits {logit_err}, loss {loss_err}"
    )
    assert results[0]["plot"] and Path(results[0]["plot"]).read_bytes()[:8] == PNG
    assert all(out["plot"] is None for out in results[1:]), "the plot is rank 0's job"
    return logit_err, loss_err


# ---- fast tier -----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 4], ids=["ulysses", "fpdt"])
def test_two_ranks_equal_one_process(dist_pool, tmp_path, chunk):
    _check(dist_pool(2).run(_validate_on_rank, 2, chunk, str(tmp_path)))


def test_one_device_without_the_strategy(tmp_path):
    out = _validate({"devices": 1}, str(tmp_path))
    _check([out])
    assert out["plot"] == os.path.join(str(tmp_path), "needle.png")
    rows = out["table"].splitlines()  # what it prints: a header, the lengths, one row per depth, the PNG
    assert rows[1].split()[-2:] == ["30", "64"] and len(rows) == 3 + len(DEPTHS)
    assert rows[2].split() == ["0%", *(f"{out['run']['accuracy'][(n, 0.0)]:.2f}" for n in LENGTHS)]


def test_passkey_prompt_layout():
    """Exactly ``length`` tokens; the needle at the sentence boundary nearest the depth; the answer last."""
    tok = ByteTokenizer()
    prompt = PasskeyPrompt(tok)
    for length in (prompt.minimum_length, 300, 1000):
        for depth in (0.0, 0.3, 1.0):
            s = prompt.sample(length, depth, 1)
            text = tok.decode(s.input_ids.tolist())
            key = text.rsplit(" ", 1)[1]
            assert s.input_ids.shape == (length,) and s.input_ids[0] == tok.bos_token_id
            assert len(key) == 5 and s.answer_len == 6 and text.endswith(f"The pass key is {key}")
            assert tok.decode(s.input_ids[s.needle_at :].tolist()).startswith(f" The pass key is {key}.")
            at, haystack = s.needle_at - len(prompt.prefix), length - prompt.minimum_length
            assert abs(at - depth * haystack) <= 24, (length, depth, at)  # a filler sentence: <= 22 bytes
    assert prompt.sample(300, 0.5, 1).input_ids.equal(PasskeyPrompt(tok).sample(300, 0.5, 1).input_ids)
    assert not prompt.sample(300, 0.5, 1).input_ids.equal(prompt.sample(300, 0.5, 2).input_ids)
    with pytest.raises(ValueError, match=f"use lengths >= {prompt.minimum_length}"):
        prompt.sample(prompt.minimum_length - 1, 0.5, 0)
    tokens = PasskeyPrompt(tok, torch.arange(3, 40), task="").sample(200, 0.5, 0)
    assert tokens.input_ids.shape == (200,)


def test_long_recall_task_and_its_grid():
    """The demo's data: values only in the span, every label a query's answer after it; its needle prompt: the
    span at the depth, the query and its answer last."""
    from lightning_longctx.recipes.recall import LongRecallDataModule

    data = LongRecallDataModule(seq_len=256, val_samples=2)
    t = data.train_dataset.tokens
    for split in (data.train_dataset, data.val_dataset):
        for i in range(len(split) if split is data.val_dataset else 4):
            ids, labels = split[i]["input_ids"], split[i]["labels"]
            values = torch.nonzero((ids >= t.value0) & (ids < t.filler0))[:, 0]
            assert len(values) == 64 and int(values[-1] - values[0]) == 63  # one span of a quarter
            assert split is data.train_dataset or int(values[0]) == 0  # validation: the span opens the row
            asked = torch.nonzero(labels != -100)[:, 0]
            assert (
                len(asked) > 10 and bool((asked > values[-1]).all()) and bool((ids[asked] == t.BLANK).all())
            )
            keys = ids[asked - 1] - t.query0
            stated = {int((v - t.value0) // t.num_values): int(v) for v in ids[values]}
            assert [stated[int(k)] for k in keys] == labels[asked].tolist()  # the answer is the span's value
    prompt = data.needle_prompt()
    for depth in (0.0, 0.5, 1.0):
        s = prompt.sample(512, depth, 3)
        ids = s.input_ids
        key, answer = int(ids[-2] - t.query0), int(ids[-1])
        in_span = ids[s.needle_at : s.needle_at + 128]
        assert ids.shape == (512,) and s.answer_len == 1 and 0 <= key < t.num_keys
        assert bool(((in_span >= t.value0) & (in_span < t.filler0)).all()) and answer in in_span.tolist()
        assert s.needle_at == round(depth * (512 - 2 - 128))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(lengths=[]), "positive token counts"),
        (dict(lengths=[64, 1]), "positive token counts"),
        (dict(lengths=[64, 64]), "twice"),
        (dict(lengths=[64], depths=[0.5, 1.5]), r"in \[0, 1\]"),
        (dict(lengths=[64], depths=[0.5, 0.5]), "twice"),
        (dict(lengths=[64], samples=0), "positive integer"),
        (dict(lengths=[64], prompt="passkey"), "not a NeedlePrompt"),
    ],
)
def test_bad_settings_say_what_and_how_to_fix(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        NeedleRetrieval(**kwargs)


def test_the_run_tokenizer_and_refusals_before_the_first_step(tmp_path):
    """The datamodule's tokenizer builds the passkey prompts; a length too short for them, a datamodule
    without a tokenizer and a model vocabulary too small are refused when fit starts, before any step."""
    from lightning_longctx.data import TextFilesDataModule
    from lightning_longctx.recipes import RecallDataModule

    (tmp_path / "doc.txt").write_text("One two three. Four five six. " * 40)
    text = TextFilesDataModule([str(tmp_path / "doc.txt")], seq_len=64, val_fraction=0.0)

    def fit(callback, data, vocab=VOCAB):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[callback],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path), limit_val_batches=0)  # fmt: skip
        trainer.fit(
            _ValModule(tiny_model("llama", vocab=vocab), dataset=TokenDataset(1, 16)), datamodule=data
        )
        return callback

    with pytest.raises(ValueError, match="need at least 252 tokens"):
        fit(NeedleRetrieval([128]), text)
    with pytest.raises(ValueError, match=r"RecallDataModule has no tokenizer.*tokenizer='byte'"):
        fit(NeedleRetrieval([512]), RecallDataModule(seq_len=32, train_samples=2, val_samples=2))
    with pytest.raises(ValueError, match="token ids up to 258 but LlamaForCausalLM has vocab_size=64"):
        fit(NeedleRetrieval([512], filler=str(tmp_path / "doc.txt")), text, vocab=64)
    callback = fit(NeedleRetrieval([300]), text)
    assert isinstance(callback._prompt, PasskeyPrompt) and callback._prompt.vocab_size == VOCAB


# ---- the full matrix -----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 4], ids=["ulysses", "fpdt"])
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_matrix_equals_one_process(dist_pool, tmp_path, sp, chunk):
    _check(dist_pool(sp).run(_validate_on_rank, sp, chunk, str(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 4], ids=["ulysses", "fpdt"])
def test_data_parallel_times_sequence_parallel_equals_one_process(dist_pool, tmp_path, chunk):
    """dp = 2 x sp = 2: each sequence-parallel group scores half the cells; one all-reduce joins them."""
    _check(dist_pool(4).run(_validate_on_rank, 2, chunk, str(tmp_path)))
