"""NeedleRetrieval: the needle grid's per-cell exact match, the answer tokens' logits and loss equal one process's.

Reference: the plain model on each whole prompt in float32, logits at the answer's positions. The prompts end,
for two of three samples, with the reference model's own greedy answer (retrieved by construction) and otherwise
with a random key (almost never retrieved), so the cells hold 0, 0.5 and 1. While the callback scores, hooks
record on every rank each forward of the model (its boolean ``logits_to_keep``, or none: full logits), the rows
its lm_head projected (only the answer positions that rank holds) and every reduction or gather (the claim: one
all-reduce per run). A model that runs an extra full-logits pass is refused by the callback and, with that
guard switched off, still fails this file's own check.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaForCausalLM, LlamaModel

from helpers.hf_models import HFModule, TokenDataset, tiny_config, tiny_model
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.data import ByteTokenizer
from lightning_longctx.lightning.callbacks import NeedleRetrieval
from lightning_longctx.lightning.callbacks import needle as needle_module
from lightning_longctx.lightning.callbacks.needle import (
    METRIC_PREFIX,
    NeedlePrompt,
    NeedleSample,
    PasskeyPrompt,
)
from lightning_longctx.testing import Sabotage, assert_catches, sabotaged

NEEDLE = "lightning_longctx.lightning.callbacks.needle"
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


class _Scored(NeedleRetrieval):
    """The callback as shipped; ``scoring`` is True while its validation-end scoring runs (what the hooks of
    this file record)."""

    scoring = False

    def on_validation_epoch_end(self, trainer, pl_module):
        self.scoring = True
        try:
            super().on_validation_epoch_end(trainer, pl_module)
        finally:
            self.scoring = False


class _ExtraFullLogits(LlamaForCausalLM):
    """Sabotage: a forward that also computes the full ``(tokens, vocab)`` logits and drops them."""

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
        super().forward(input_ids=input_ids, **kwargs)
        return super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)


class _ExtraCall(_Scored):
    """Sabotage: the callback calls the model once more per batch, without ``logits_to_keep``."""

    def _score(self, trainer, model, batch, projected):
        length, depth = self.cells[batch.cell]
        model(input_ids=self._prompt.sample(length, depth, 0).input_ids[None], use_cache=False)
        return super()._score(trainer, model, batch, projected)


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
    accuracy, loss, rows, every = {}, {}, {}, [0.0, 0]
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
            every = [every[0] + total, every[1] + count]
    # val/needle/loss: every answer token of the grid, one mean
    return {"accuracy": accuracy, "loss": loss, "rows": rows, "mean_loss": every[0] / every[1]}


def _recording(model: torch.nn.Module, callback: _Scored) -> list[dict]:
    """Every forward of ``model`` while ``callback`` scores, boolean ``logits_to_keep`` or not: ``keep`` (the
    positions it keeps; ``None``: no boolean one, full logits), ``projected`` (the rows the lm_head projected
    during it) and, for a boolean one, ``samples`` / ``positions`` / ``logits`` of the kept rows."""
    seen, head_rows = [], [0]

    def count(module, args):
        head_rows[0] += args[0].shape[:-1].numel()

    def start(module, args, kwargs):
        head_rows[0] = 0

    def hook(module, args, kwargs, output):
        if not callback.scoring:
            return
        keep = kwargs.get("logits_to_keep")
        record = {"keep": None, "projected": head_rows[0]}
        if isinstance(keep, torch.Tensor) and keep.dtype == torch.bool:
            pos = kwargs.get("position_ids")
            pos = torch.arange(keep.shape[1]).expand_as(keep) if pos is None else pos.expand_as(keep)
            record.update(keep=int(keep.sum()), samples=keep.nonzero()[:, 0], positions=pos[keep],
                          logits=output.logits.detach().clone())  # fmt: skip
        seen.append(record)

    model.get_output_embeddings().register_forward_pre_hook(count)
    model.register_forward_pre_hook(start, with_kwargs=True)
    model.register_forward_hook(hook, with_kwargs=True)
    return seen


#: the collectives that reduce or gather (the attention's all-to-alls and Lightning's broadcast of its log
#: folder are not counted)
REDUCTIONS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
)


@contextmanager
def _reductions(callback: _Scored):
    """``[(name, shape)]`` of every reduction or gather (:data:`REDUCTIONS`) called while ``callback`` scores;
    each call runs the real collective."""
    calls, real = [], {name: getattr(dist, name) for name in REDUCTIONS}

    def counted(name):
        def call(tensor, *args, **kwargs):
            if callback.scoring:
                calls.append((name, tuple(getattr(tensor, "shape", ()))))
            return real[name](tensor, *args, **kwargs)

        return call

    for name in REDUCTIONS:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _full_logits_passes(seen: list[dict]) -> list[str]:
    """The scoring forwards that computed more than the answer's logits: no boolean ``logits_to_keep``, or an
    lm_head that projected other rows than the kept ones (an extra pass inside the forward)."""
    bad = []
    for i, f in enumerate(seen):
        if f["keep"] is None:
            bad.append(
                f"forward {i}: no boolean logits_to_keep (full logits, {f['projected']} rows projected)"
            )
        elif f["projected"] != f["keep"]:
            bad.append(
                f"forward {i}: the lm_head projected {f['projected']} rows for {f['keep']} kept positions"
            )
    return bad


def _no_full_logits(out: dict) -> None:
    found = _full_logits_passes(out["seen"])
    assert not found, f"full-logits passes while scoring: {found}"


def _logged(trainer: L.Trainer) -> dict[str, float]:
    return {
        k.removeprefix(METRIC_PREFIX): float(v)
        for k, v in trainer.callback_metrics.items()
        if k.startswith(METRIC_PREFIX)
    }


def _validate(trainer_kwargs: dict, root: str, model=None, callback_class=_Scored, lengths=LENGTHS) -> dict:
    callback = callback_class(lengths, DEPTHS, samples=SAMPLES, batch_size=SAMPLES, prompt=_GreedyPrompt())
    module = _ValModule(tiny_model("llama", vocab=VOCAB) if model is None else model)
    seen = _recording(module.model, callback)
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
    with _reductions(callback) as reduced:
        trainer.validate(module, DataLoader(TokenDataset(2, 32), batch_size=1), verbose=False)
    strategy = trainer.strategy
    return {
        "run": callback.history[-1],
        "logged": _logged(trainer),
        "seen": seen,
        "reduced": reduced,
        "world": trainer.world_size,
        "dp": (getattr(strategy, "dp_rank", 0), getattr(strategy, "dp_size", 1)),
        "plot": callback.plot_path,
        "table": callback.table(),
    }


def _validate_on_rank(sp: int, chunk: int | None, root: str) -> dict:
    lightning_env()
    extra = {} if chunk is None else {"fpdt_chunk_size": chunk}
    strategy = UlyssesFPDTStrategy(sequence_parallel_size=sp, **extra)
    return _validate({"strategy": strategy, "devices": dist.get_world_size()}, root)


#: what :func:`_reductions` records in a multi-rank run: one all-reduce of the (samples, 3) table
TABLE_REDUCED = [("all_reduce", (len(LENGTHS) * len(DEPTHS) * SAMPLES, 3))]


def _check(results: list[dict]) -> tuple[float, float]:
    """``(max error of the answer logits, of the losses: each cell's and the logged val/needle/loss)`` vs one
    process; asserts the rest exactly: the cells, no full-logits pass, one all-reduce per run."""
    ref = _reference()
    values = set(ref["accuracy"].values())
    assert len(values) > 1, f"the reference cells are all {values}: the comparison would prove little"
    logit_err = loss_err = 0.0
    for out in results:
        assert out["run"]["accuracy"] == ref["accuracy"], (out["run"]["accuracy"], ref["accuracy"])
        loss_err = max(loss_err, *(abs(out["run"]["loss"][c] - v) for c, v in ref["loss"].items()))
        loss_err = max(loss_err, abs(out["logged"]["loss"] - ref["mean_loss"]))
        want = {f"{n}/{d:g}": v for (n, d), v in ref["accuracy"].items()}
        want["mean"] = sum(ref["accuracy"].values()) / len(ref["accuracy"])
        assert {k: v for k, v in out["logged"].items() if k != "loss"} == pytest.approx(want, abs=1e-7)
        _no_full_logits(out)
        # the scores of every rank joined by one all-reduce of the (samples, 3) table per run; none at world 1
        reduced = out["reduced"]
        assert reduced == (TABLE_REDUCED if out["world"] > 1 else []), f"reductions while scoring: {reduced}"
    # the answer's logits: the rows every rank's lm_head projected, each answer position once, nothing else
    by_forward: dict[tuple[int, int], list] = {}
    for out in results:
        rank, size = out["dp"]
        for j, f in enumerate(out["seen"]):
            cell = rank + j * size  # batches[rank::size]; one batch per cell (batch_size = samples)
            by_forward.setdefault((cell, rank), []).append((f["samples"], f["positions"], f["logits"]))
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


def _unguarded(check):
    """Sabotage: the callback's full-logits guard (``_ProjectedRows.check``) counts and lets everything pass."""

    def let_pass(self, wanted, name, after="in one scoring forward"):
        self.rows = 0

    return let_pass


GUARD_OFF = Sabotage("the full-logits guard off", f"{NEEDLE}:_ProjectedRows.check", _unguarded)


def test_a_full_logits_pass_while_scoring_fails(tmp_path):
    """Sabotage: a model whose forward also projects every position (and drops those logits) is refused by the
    callback's guard. With the guard off, this file's own check names it, and a callback that calls the model
    once more without logits_to_keep."""
    kept = SAMPLES * 3  # a cell's answers: 3 bytes (" " and a key of 2 digits) per prompt
    refused = (
        f"projected {SAMPLES * LENGTHS[0] + kept} positions onto the vocabulary in one scoring forward, but "
        f"this rank holds {kept} answer positions"
    )
    with pytest.raises(RuntimeError, match=refused):
        _validate({"devices": 1}, str(tmp_path), model=_ExtraFullLogits(tiny_config("llama", vocab=VOCAB)))

    def no_full_logits_with_both_extra_passes():
        model = _ExtraFullLogits(tiny_config("llama", vocab=VOCAB))
        _no_full_logits(_validate({"devices": 1}, str(tmp_path), model, _ExtraCall, lengths=LENGTHS[:1]))

    caught = assert_catches(no_full_logits_with_both_extra_passes, GUARD_OFF)
    # per cell (of LENGTHS[0] tokens): the callback's extra call (the sabotaged forward projects its n tokens
    # twice), then the scoring forward (its prompts' tokens, then the answer positions)
    n = LENGTHS[0]
    want = [
        line
        for i in range(len(DEPTHS))
        for line in (
            f"forward {2 * i}: no boolean logits_to_keep (full logits, {2 * n} rows projected)",
            f"forward {2 * i + 1}: the lm_head projected {SAMPLES * n + kept} rows for {kept} kept positions",
        )
    ]
    assert str(caught).startswith(f"full-logits passes while scoring: {want}"), str(caught)


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


class _Unbuildable(NeedlePrompt):
    """A prompt of one's own that cannot be built at the lengths asked for."""

    def sample(self, length: int, depth: float, index: int) -> NeedleSample:
        raise ValueError(f"context length {length} is too short for this prompt; use lengths >= 1000")


def test_the_run_tokenizer_and_refusals_before_the_first_step(tmp_path):
    """The datamodule's tokenizer builds the passkey prompts. Refused when fit starts, before any step (the
    CHANGELOG's list): unbuildable prompts (a length too short for the passkey, a prompt of one's own that
    raises), a datamodule without a tokenizer, a model vocabulary too small, a model without logits_to_keep.
    RoPE overruns: :func:`test_a_rope_overrun_is_refused_on_every_rank` (they need the strategy's context)."""
    from lightning_longctx.data import TextFilesDataModule
    from lightning_longctx.recipes import RecallDataModule

    (tmp_path / "doc.txt").write_text("One two three. Four five six. " * 40)
    text = TextFilesDataModule([str(tmp_path / "doc.txt")], seq_len=64, val_fraction=0.0)
    modules = []

    def fit(callback, data, vocab=VOCAB, model=None):
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, callbacks=[callback],
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=str(tmp_path), limit_val_batches=0)  # fmt: skip
        modules.append(_ValModule(model or tiny_model("llama", vocab=vocab), dataset=TokenDataset(1, 16)))
        trainer.fit(modules[-1], datamodule=data)
        return callback

    refusals = [
        (dict(callback=NeedleRetrieval([128]), data=text), "need at least 252 tokens"),
        (dict(callback=NeedleRetrieval([64], prompt=_Unbuildable()), data=text), "use lengths >= 1000"),
        (dict(callback=NeedleRetrieval([512]), data=RecallDataModule(seq_len=32, train_samples=2, val_samples=2)),
         r"RecallDataModule has no tokenizer.*tokenizer='byte'"),
        (dict(callback=NeedleRetrieval([512], filler=str(tmp_path / "doc.txt")), data=text, vocab=64),
         "token ids up to 258 but LlamaForCausalLM has vocab_size=64"),
        (dict(callback=NeedleRetrieval([300]), data=text, model=LlamaModel(tiny_config("llama", vocab=VOCAB))),
         "LlamaModel.forward takes no logits_to_keep"),
    ]  # fmt: skip
    for kwargs, match in refusals:
        with pytest.raises(ValueError, match=match):
            fit(**kwargs)
        assert modules[-1].losses == [], f"{match!r} was refused after a step"
    callback = fit(NeedleRetrieval([300]), text)
    assert isinstance(callback._prompt, PasskeyPrompt) and callback._prompt.vocab_size == VOCAB
    assert len(modules[-1].losses) == 1  # the same run without a refusal steps


def _rope_overrun_on_rank(root: str) -> tuple[str | None, int]:
    """A needle length past the tiny Llama's RoPE (max_position_embeddings 512) under the strategy: the error
    and the steps run."""
    lightning_env()
    module = _ValModule(tiny_model("llama", vocab=VOCAB), dataset=TokenDataset(2, 32))
    trainer = L.Trainer(strategy=UlyssesFPDTStrategy(sequence_parallel_size=2), accelerator="cpu", devices=2,
                        max_steps=1, logger=False, default_root_dir=root, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[NeedleRetrieval([600], prompt=PasskeyPrompt(ByteTokenizer()))])  # fmt: skip
    try:
        trainer.fit(module)
    except ValueError as err:
        return str(err), len(module.losses)
    return None, len(module.losses)


def test_a_rope_overrun_is_refused_on_every_rank(dist_pool, tmp_path):
    for msg, steps in dist_pool(2).run(_rope_overrun_on_rank, str(tmp_path)):
        assert msg is not None and steps == 0, (msg, steps)
        assert "a sequence of 600 positions, but the model's RoPE covers 512" in msg, msg


def _reduce_per_batch(score):
    """Sabotage: the callback all-reduces once per scoring forward besides the run's one."""

    def score_and_reduce(self, trainer, model, batch, projected):
        rows, stats = score(self, trainer, model, batch, projected)
        needle_module.all_reduce_no_grad(stats.new_zeros(1))
        return rows, stats

    return score_and_reduce


def _loss_logged_off(log_equal):
    """Sabotage: ``val/needle/loss`` logged 1e-4 off what was scored."""
    return lambda module, name, value: log_equal(module, name, value + 1e-4 * name.endswith("/loss"))


PER_BATCH = Sabotage("an all-reduce per batch", f"{NEEDLE}:NeedleRetrieval._score", _reduce_per_batch)
LOSS_OFF = Sabotage("val/needle/loss logged 1e-4 off", f"{NEEDLE}:log_equal", _loss_logged_off)


@pytest.mark.slow
def test_the_run_checks_fail_on_extra_reductions_and_a_wrong_logged_loss(dist_pool, tmp_path):
    """Sabotage, on the sp 2 run of :func:`test_two_ranks_equal_one_process`: :func:`_check` fails when the
    callback all-reduces once per batch (7 reductions where one joins the run) and when the logged
    val/needle/loss is 1e-4 off the one-process reference."""
    for sabotage, match in (
        (
            PER_BATCH,
            re.escape(f"reductions while scoring: {[('all_reduce', (1,))] * len(_cells()) + TABLE_REDUCED}"),
        ),
        (LOSS_OFF, r"max error vs one process: logits \S+, loss 9\.9\d*e-05"),
    ):
        run = sabotaged(sabotage, _validate_on_rank)
        assert_catches(
            lambda run=run: _check(dist_pool(2).run(run, 2, None, str(tmp_path))), sabotage, match=match
        )


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
