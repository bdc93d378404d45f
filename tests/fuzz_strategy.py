"""Randomized differential testing of the strategy: one real ``Trainer`` step against one process.

:func:`strategy_cases` draws what the package exists for most often (weights: :data:`LAYOUTS`,
:data:`FAMILIES`, :data:`RINGS`): sequence parallelism at 2 and 4 (beside data or tensor parallelism too),
Ulysses x ring (``ring_size`` 2 and 4, in both modes), FPDT (chunk size) with offload, packed documents and the
hybrid models; and less often one process, data or tensor parallelism alone, and any dense architecture of the
sweep (``arch_sweep.ARCHS``; the MoE auxiliary loss has its own tests), the refused ones included. Besides: the
sequence length (also one that does not divide), gradient accumulation, FPDT overlap, activation checkpointing,
activation offload, DDP or FSDP2 (with or without model-state offload to the host; tensor parallelism over 2
ranks under FSDP2: dp = world / (sp * tp)), packed documents (position ids restarting at 0, the first label of a
document ignored as ``DataCollatorWithFlattening`` does), the loss normalization, a checkpoint round trip after
the step (sharded or full: saved, the parameters overwritten, loaded back) and the evaluation callbacks in a
validation run after the step: ``PositionalLoss`` (by token or by document position) and ``NeedleRetrieval`` (a
short passkey grid). :func:`distribution` counts what a sample drew.

:func:`run_strategy` trains one optimizer step (SGD) under ``UlyssesFPDTStrategy`` on every rank and compares
EVERY parameter with a single-process loop on the same global batch, which runs each packed document on its own
(so the reference knows nothing of our document masks), and the callbacks' metrics with the same loop's model
after its step: relative error within :data:`TOLERANCE`, or a refusal the package documents for that
configuration (:data:`EXPECTED_REFUSALS`; any other refusal fails, ``fuzz_common``).
"""

from __future__ import annotations

import collections
import functools
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fuzz_common import REFUSALS, ExpectedRefusal, refusal_or_raise
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler

TOLERANCE = 1e-5
TIMEOUT_S = 240.0  # per example: one Trainer step of a tiny model; world 4 on 2 cores takes ~10 s
#: A parameter that is zero up to float noise (OPT's key biases start at 0 and get a gradient that softmax
#: cancels: 1e-11 either way) is compared against this fraction of the model's largest parameter instead
#: of its own size, as the architecture sweep does for gradients; an error above 1e-8 of it still fails.
FLOOR = 1e-3
LR = 0.5
VOCAB = 96  # arch_sweep's vocabulary
POSITIONAL_BUCKETS = dict(first=4, log_base=2)  # 0-3, 4-7, 8-15, 16-31
NEEDLE_DEPTHS = (0.0, 1.0)


@functools.lru_cache(maxsize=1)
def _dense_archs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The sweep's dense architectures: ``(exact in both modes, all)``; the first from the sweep's
    generated page (tests/test_arch_sweep.py keeps it current)."""
    from arch_sweep import ARCHS, DOCS

    dense = tuple(a.name for a in ARCHS if not a.moe)
    exact = set(re.findall(r"^\| `([\w-]+)` \|.*\| exact \| exact \|$", DOCS.read_text(), flags=re.M))
    return tuple(n for n in dense if n in exact), dense


@dataclass(frozen=True)
class StratCase:
    """One drawn Trainer run. ``fpdt_chunk_size`` None is Ulysses."""

    arch: str
    world: int
    sp: int
    seq: int
    accumulate: int = 1
    fpdt_chunk_size: int | None = None
    offload: bool = False
    fpdt_overlap: bool = True
    activation_checkpointing: bool = False
    activation_offload: bool = False
    data_parallel: str = "ddp"
    cpu_offload: bool = False
    tensor_parallel_size: int = 1
    packed: bool = False
    loss_normalization: str = "tokens"
    seed: int = 0
    #: after the step: save a checkpoint in this format, scramble the parameters, load it back (None: no)
    checkpoint: str | None = None
    #: a validation run after the step with ``PositionalLoss(by=...)`` ("token" / "document"; None: none)
    positional_loss: str | None = None
    #: the same validation run scores a passkey grid with ``NeedleRetrieval`` (models whose forward takes
    #: ``logits_to_keep``; the callback refuses the others, tests/test_needle.py)
    needle: bool = False
    #: Ulysses x ring (``ring_size``; Ulysses and FPDT modes; attention-only and hybrid models alike: the mixers' halos and
    #: state scans follow the zigzag's segment order)
    ring_size: int = 1

    @property
    def mode(self) -> str:
        return "ulysses" if self.fpdt_chunk_size is None else "fpdt"

    @property
    def dp(self) -> int:
        return self.world // (self.sp * self.tensor_parallel_size)


def _weighted(weights: dict) -> list:
    """The keys of ``weights``, each repeated its weight times, in order: ``st.sampled_from`` then draws each in
    proportion to its weight (and shrinks toward the first)."""
    return [key for key, weight in weights.items() for _ in range(weight)]


#: (world, sp, tp), each drawn in proportion to its weight: sequence parallelism at 2 and 4, alone or beside data
#: or tensor parallelism, in 13 of 16 draws; one process, data parallelism alone, tensor parallelism alone in 3
LAYOUTS = {(2, 2, 1): 4, (4, 4, 1): 4, (4, 2, 1): 3, (4, 2, 2): 2, (1, 1, 1): 1, (2, 1, 1): 1, (2, 1, 2): 1}
#: sp -> the ring degrees (Ulysses x ring, ``ring_size``) drawn at it, each in proportion to its weight
RINGS = {1: {1: 1}, 2: {2: 1, 1: 1}, 4: {4: 1, 2: 1, 1: 1}}
#: where the architecture is drawn from, in proportion: the sweep's dense attention models it finds exact, its
#: exact hybrids (convolution halos, state passing), or any dense model of the sweep (refused ones as documented)
FAMILIES = {"attention": 3, "hybrid": 2, "any": 1}


@st.composite
def strategy_cases(draw: st.DrawFn, archs: list[str] | None = None) -> StratCase:
    """One drawn Trainer run (module docstring); ``archs``: draw the architecture from these alone."""
    from arch_sweep import HYBRIDS

    world, sp, tp = draw(st.sampled_from(_weighted(LAYOUTS)))
    exact, dense = _dense_archs()
    pools = {
        "attention": [a for a in exact if a not in HYBRIDS],
        "hybrid": [a for a in exact if a in HYBRIDS],
        "any": list(dense),
    }
    pool = archs or pools[draw(st.sampled_from(_weighted(FAMILIES)))]
    chunk = draw(st.sampled_from([None, None, None, 4, 3, 2]))  # Ulysses in half the draws, else FPDT's chunk
    data_parallel = "fsdp" if tp > 1 else draw(st.sampled_from(["ddp", "fsdp"]))
    return StratCase(
        arch=draw(st.sampled_from(pool)),
        world=world,
        sp=sp,
        seq=draw(st.sampled_from([24, 16, 23])),
        accumulate=draw(st.integers(1, 2)),
        fpdt_chunk_size=chunk,
        offload=chunk is not None and draw(st.sampled_from([True, True, True, False])),
        fpdt_overlap=chunk is None or draw(st.booleans()),
        activation_checkpointing=draw(st.booleans()),
        activation_offload=draw(st.booleans()),
        data_parallel=data_parallel,
        cpu_offload=data_parallel == "fsdp" and draw(st.booleans()),
        tensor_parallel_size=tp,
        packed=draw(st.sampled_from([True, True, False])),
        loss_normalization=draw(st.sampled_from(["tokens", "micro_batch"])),
        seed=draw(st.integers(0, 2**16)),
        checkpoint=draw(st.sampled_from([None, "sharded", "full"])),
        positional_loss=draw(st.sampled_from([None, "token", "document"])),
        needle=draw(st.booleans()),
        ring_size=draw(st.sampled_from(_weighted(RINGS[sp]))),  # both modes: FPDT chunks in the ring
    )


def distribution(cases: Iterable[StratCase]) -> dict[str, dict[str, int]]:
    """How often each value of the dimensions the package exists for was drawn, e.g. ``{"sp": {"1": 3, "2": 21,
    "4": 16}, "hybrid": {"False": 26, "True": 14}, ...}`` (``offload``: FPDT's; ``hybrid``: ``arch_sweep.HYBRIDS``)."""
    from arch_sweep import HYBRIDS

    dims = {
        "sp": lambda c: c.sp,
        "ring": lambda c: c.ring_size,
        "mode": lambda c: c.mode,
        "offload": lambda c: c.offload,
        "packed": lambda c: c.packed,
        "hybrid": lambda c: c.arch in HYBRIDS,
        "world": lambda c: c.world,
        "dp": lambda c: c.dp,
        "tp": lambda c: c.tensor_parallel_size,
    }
    cases = list(cases)
    return {
        name: dict(sorted(collections.Counter(str(f(c)) for c in cases).items())) for name, f in dims.items()
    }


# ---------------------------------------------------------------------------------------------------
# What the package documents as refused: every other drawn configuration it promises to run
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchFacts:
    """What the package's documents and the model's config say about one sweep architecture."""

    #: mode -> the refusal docs/architectures.md records for it (the sweep's generated page)
    refused: dict[str, str]
    #: the config declares a tensor-parallel plan (``base_model_tp_plan``)
    tp_plan: bool
    #: tokens a segment needs from the one before it: a causal ``nn.Conv1d``'s k-1 (0: no such mixer)
    halo: int


@functools.lru_cache(maxsize=1)
def _sweep_refusals() -> dict[tuple[str, str], str]:
    """``(arch, mode) -> message`` of the "Refusals and failures" list of docs/architectures.md."""
    from arch_sweep import DOCS

    out = {}
    for name, modes, message in re.findall(
        r"^\* `([\w-]+)` \(([\w, ]+)\) refused: (.*)$", DOCS.read_text(), re.M
    ):
        for mode in modes.split(", "):
            out[name, mode] = message
    return out


@functools.cache
def arch_facts(name: str) -> ArchFacts:
    """:class:`ArchFacts` of the sweep architecture ``name`` (its tiny model built once, for the halo)."""
    from arch_sweep import HYBRIDS, arch_by_name, build_config, build_model

    arch = arch_by_name(name)
    halo = 0
    if name in HYBRIDS:
        convs = [m for m in build_model(arch).modules() if isinstance(m, torch.nn.Conv1d)]
        halo = max([1] + [m.kernel_size[0] - 1 for m in convs])  # 1: RWKV's token shift
    return ArchFacts(
        refused={m: msg for (a, m), msg in _sweep_refusals().items() if a == name},
        tp_plan=bool(getattr(build_config(arch), "base_model_tp_plan", None)),
        halo=halo,
    )


def segment_length(case: StratCase) -> int:
    """Tokens of the segments a hybrid's mixers run on (docs/troubleshooting.md: an FPDT chunk, the local shard,
    or half of it under ``ring_size``), after the strategy's padding to a multiple of sp (x 2 with a ring, x the
    chunk in FPDT; a sequence shorter than a chunk per rank, or per half, takes a chunk of what it has)."""
    per_segment = -(-case.seq // (case.sp * (2 if case.ring_size > 1 else 1)))
    return per_segment if case.fpdt_chunk_size is None else min(case.fpdt_chunk_size, per_segment)


#: Models whose TP plan misses a parameter that consumes the activations it splits (docs/troubleshooting.md)
TP_PLAN_MISSES = ("apertus",)

#: The refusals the package documents for configurations :func:`strategy_cases` draws, and why each is expected. A
#: refused trial that none of them applies to, or none whose message matches, is a configuration the package
#: promises to run, and fails (``fuzz_common.classify_refusal``).
EXPECTED_REFUSALS = (
    ExpectedRefusal(
        "architecture the sweep refuses",
        applies=lambda c: c.mode in arch_facts(c.arch).refused,
        message=lambda c: re.escape(arch_facts(c.arch).refused[c.mode][:80]),
        reason="docs/architectures.md (the sweep's page, kept current by tests/test_arch_sweep.py) records this "
        "(architecture, mode) as refused, with this message: attention computed inline (Bloom, MPT, Falcon, "
        "GPT-Neo, StableLM), a model that edits its own mask (Doge), a logits transform FPDT's chunked loss cannot "
        "reproduce (ModernBERT-decoder under FPDT). The strategy patches the model at sp 1 too",
    ),
    ExpectedRefusal(
        "no tensor-parallel plan",
        applies=lambda c: c.tensor_parallel_size > 1 and not arch_facts(c.arch).tp_plan,
        message=r"declares no tensor-parallel plan",
        reason="docs/troubleshooting.md, docs/user_guide.md: tensor_parallel_size splits a model by its own plan "
        "(config.base_model_tp_plan); GPT-2, OPT, Persimmon, BitNet, the Mamba family, xLSTM, RWKV declare none",
    ),
    ExpectedRefusal(
        "a parameter the TP plan misses",
        applies=lambda c: c.tensor_parallel_size > 1 and c.arch in TP_PLAN_MISSES,
        message=r"differ across the tensor-parallel ranks",
        reason="docs/troubleshooting.md: Apertus' learnable xIELU consumes the activations its plan splits; "
        "refused after the first backward, before the first update",
    ),
    ExpectedRefusal(
        "a segment shorter than a convolution's halo",
        applies=lambda c: arch_facts(c.arch).halo > segment_length(c),
        message=r"needs the last \d+ tokens before each segment",
        reason="docs/troubleshooting.md: a causal convolution of kernel k takes the k-1 tokens before each segment "
        "from the segment before it alone: Qwen3.5's, OLMo-hybrid's and the Mamba family's k = 4 with FPDT chunks "
        "of 2, or Ulysses x ring 4 over 16 tokens (2 per zigzag half)",
    ),
)


class FuzzDataset(Dataset):
    """Random tokens with SFT-style labels (a prompt of random length ignored); ``packed``: 1-3 documents
    per sample with restarting ``position_ids`` and the first label of every document ignored. Every
    sample keeps at least one target."""

    def __init__(self, n: int, seq: int, packed: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            ids = torch.randint(3, VOCAB, (seq,), generator=g)
            labels = ids.clone()
            labels[: int(torch.randint(0, seq // 3, (), generator=g))] = -100
            row = {"input_ids": ids, "labels": labels}
            if packed:
                cuts = sorted(set(torch.randint(1, seq - 1, (int(torch.randint(0, 3, (), generator=g)),),
                                                generator=g).tolist()))  # fmt: skip
                pos = torch.arange(seq)
                for a, b in zip(cuts, [*cuts[1:], seq]):
                    pos[a:b] = torch.arange(b - a)
                    labels[a] = -100
                row["position_ids"] = pos
            labels[-1] = ids[-1]  # keeps one target whatever the prompt and documents cut
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _documents(row: dict) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the sample's packed documents."""
    pos = row.get("position_ids")
    n = len(row["input_ids"])
    starts = [0] if pos is None else [0, *[t for t in range(1, n) if int(pos[t]) == 0]]
    return list(zip(starts, [*starts[1:], n]))


def _token_loss_sum(model: torch.nn.Module, row: dict) -> tuple[torch.Tensor, int]:
    """Sum of the sample's token losses and its valid-target count: each document run alone (plain
    positions, no mask of ours), its next-token targets inside it."""
    total, count = torch.zeros(()), 0
    for a, b in _documents(row):
        ids, labels = row["input_ids"][a:b], row["labels"][a:b]
        targets = torch.cat([labels[1:], labels.new_full((1,), -100)])  # shift inside the document
        if b < len(row["input_ids"]):  # the next document's first token is ignored (label -100)
            assert int(row["labels"][b]) == -100
        else:
            targets[-1] = -100  # the sequence's last token has no next token
        logits = model(input_ids=ids[None], position_ids=torch.arange(b - a)[None]).logits[0].float()
        total = total + F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total, count


def _token_losses(model: torch.nn.Module, row: dict) -> list[tuple[int, int, float]]:
    """``(token position, document position, loss)`` of every valid target of the sample, each document run
    alone as :func:`_token_loss_sum` runs it."""
    out = []
    with torch.no_grad():
        for a, b in _documents(row):
            ids, labels = row["input_ids"][a:b], row["labels"][a:b]
            targets = torch.cat([labels[1:], labels.new_full((1,), -100)])
            logits = model(input_ids=ids[None], position_ids=torch.arange(b - a)[None]).logits[0]
            ce = F.cross_entropy(logits.double(), targets, ignore_index=-100, reduction="none")
            out += [(a + t, t, float(ce[t])) for t in range(b - a) if int(targets[t]) != -100]
    return out


def positional_reference(model: torch.nn.Module, data: FuzzDataset, by: str) -> dict[tuple[int, int], float]:
    """What ``PositionalLoss(first=4, log_base=2, by=by)`` logs for one validation run over every row of
    ``data``: the token mean per bucket, bucketed here by hand."""
    from lightning_longctx.lightning.callbacks.positional_loss import bucket_edges

    edges = bucket_edges(**POSITIONAL_BUCKETS)
    sums: dict[int, list[float]] = {}
    for row in data.rows:
        for token, document, loss in _token_losses(model, row):
            where = token if by == "token" else document
            k = max(j for j in range(len(edges) - 1) if edges[j] <= where)
            sums.setdefault(k, []).append(loss)
    return {(edges[k], edges[k + 1] - 1): sum(v) / len(v) for k, v in sums.items()}


class CharTokenizer:
    """Characters as the ids 3 .. VOCAB - 1 (the sweep's vocabulary): the needle grid's tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [3 + ord(ch) % (VOCAB - 3) for ch in text]

    def __len__(self) -> int:
        return VOCAB


def needle_prompt():
    from lightning_longctx.lightning.callbacks.needle import PasskeyPrompt

    return PasskeyPrompt(
        CharTokenizer(), "ab. cd. ef.", needle="k{key}.", question="k?", task="", key_digits=2, add_bos=False
    )


def needle_reference(
    model: torch.nn.Module, lengths: tuple[int, ...]
) -> dict[str, dict[tuple[int, float], float]]:
    """What ``NeedleRetrieval`` records for :func:`needle_prompt` on one process: per cell the fraction of its
    prompts retrieved (teacher-forced exact match) and the answer tokens' mean cross entropy."""
    prompt, accuracy, loss = needle_prompt(), {}, {}
    with torch.no_grad():
        for n in lengths:
            for d in NEEDLE_DEPTHS:
                s = prompt.sample(n, d, 0)
                logits = model(input_ids=s.input_ids[None]).logits[0, n - s.answer_len - 1 : n - 1].double()
                target = s.input_ids[n - s.answer_len :]
                accuracy[(n, d)] = float(bool((logits.argmax(-1) == target).all()))
                loss[(n, d)] = float(F.cross_entropy(logits, target))
    return {"accuracy": accuracy, "loss": loss}


def reference_step(case: StratCase, model: torch.nn.Module, data: FuzzDataset) -> None:
    """One SGD step of one process on the global batch (dp ranks x micro-batches, Lightning's sampler
    order): the token mean over the whole window, or the mean of the micro-batches' means."""
    orders = [
        list(DistributedSampler(data, num_replicas=case.dp, rank=j, shuffle=True, seed=0))
        for j in range(case.dp)
    ]
    rows = [data[orders[j][m]] for m in range(case.accumulate) for j in range(case.dp)]  # fmt: skip
    sums = [_token_loss_sum(model, row) for row in rows]
    if case.loss_normalization == "tokens":
        loss = sum(s for s, _ in sums) / sum(c for _, c in sums)
    else:
        loss = sum(s / c for s, c in sums) / len(sums)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    loss.backward()
    opt.step()


def run_strategy(case: StratCase) -> tuple[str, object]:
    """On every rank of the default group: ``("ran", worst relative error over every parameter)`` or
    ``("refused", message)``."""
    import lightning as L
    import torch.distributed as dist
    from arch_sweep import arch_by_name, build_model

    from helpers.lightning import lightning_env
    from lightning_longctx import UlyssesFPDTStrategy

    assert dist.get_world_size() == case.world
    lightning_env()
    data = FuzzDataset(case.dp * case.accumulate, case.seq, case.packed, case.seed)
    arch = arch_by_name(case.arch)
    module = _validated_module(build_model(arch), data)
    callbacks = _callbacks(case, module.model)
    try:
        strategy = UlyssesFPDTStrategy(
            sequence_parallel_size=case.sp,
            fpdt_chunk_size=case.fpdt_chunk_size,
            offload=case.offload,
            fpdt_overlap=case.fpdt_overlap,
            activation_checkpointing=case.activation_checkpointing,
            activation_offload=case.activation_offload,
            data_parallel=case.data_parallel,
            cpu_offload=case.cpu_offload,
            tensor_parallel_size=case.tensor_parallel_size,
            loss_normalization=case.loss_normalization,
            checkpoint_format=case.checkpoint or "sharded",
            ring_size=case.ring_size,
        )
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=case.world, max_steps=1,
            accumulate_grad_batches=case.accumulate, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks.values()),
            num_sanity_val_steps=0, limit_val_batches=1.0 if callbacks else 0,
        )  # fmt: skip
        trainer.fit(module)  # validates after its step when a callback is drawn
    except REFUSALS as e:
        return refusal_or_raise(e)
    if case.checkpoint is not None:
        _checkpoint_round_trip(trainer)
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    if not state:  # FSDP gathers the full state dict on rank 0 only
        return "ran", 0.0
    ref = build_model(arch)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    reference_step(case, ref, data)
    final = ref.state_dict()
    floor = FLOOR * max(float(w.abs().max()) for w in final.values())
    worst, moved = 0.0, 0.0
    for name, want in final.items():
        moved = max(moved, float((want - init[name]).abs().max()))
        err = float((state[name] - want).abs().max()) / max(float(want.abs().max()), floor)
        worst = max(worst, err)
    if moved == 0.0:
        raise AssertionError(
            f"{case}: no parameter moved in the reference step: the comparison proves nothing"
        )
    return "ran", max(worst, _callbacks_error(case, callbacks, ref, data))


def _validated_module(model: torch.nn.Module, data: FuzzDataset):
    """``HFModule`` (the user's training step), plus the user's validation step, ``self.model(**batch)``, over the
    training rows."""
    from torch.utils.data import DataLoader

    from lightning_longctx.testing import HFModule

    class ValidatedModule(HFModule):
        def validation_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def val_dataloader(self):
            return DataLoader(self.dataset, batch_size=1)

    return ValidatedModule(model, lr=LR, dataset=data)


def _callbacks(case: StratCase, model: torch.nn.Module) -> dict[str, object]:
    from lightning_longctx.lightning.callbacks import NeedleRetrieval, PositionalLoss

    out: dict[str, object] = {}
    if case.positional_loss is not None:
        out["positional"] = PositionalLoss(**POSITIONAL_BUCKETS, by=case.positional_loss, plot=False)
    if case.needle and "logits_to_keep" in inspect.signature(type(model).forward).parameters:
        lengths = (case.seq, case.seq + 5)
        out["needle"] = NeedleRetrieval(lengths, NEEDLE_DEPTHS, samples=1, prompt=needle_prompt(), plot=False)
    return out


def _callbacks_error(
    case: StratCase, callbacks: dict[str, object], ref: torch.nn.Module, data: FuzzDataset
) -> float:
    """The drawn callbacks' metrics (fp64, before Lightning's logging) against the reference model after its
    step: the worst relative error; a missing bucket or a different cell outcome raises."""
    ref.eval()
    worst = 0.0
    positional = callbacks.get("positional")
    if positional is not None:
        got, want = positional.history[-1]["loss"], positional_reference(ref, data, case.positional_loss)
        if set(got) != set(want):
            raise AssertionError(
                f"{case}: PositionalLoss buckets {sorted(got)} != one process's {sorted(want)}"
            )
        worst = max(worst, *(abs(got[k] - v) / abs(v) for k, v in want.items()))
    needle = callbacks.get("needle")
    if needle is not None:
        run, want = needle.history[-1], needle_reference(ref, needle.lengths)
        if run["accuracy"] != want["accuracy"]:
            raise AssertionError(
                f"{case}: needle cells {run['accuracy']} != one process's {want['accuracy']}"
            )
        worst = max(worst, *(abs(run["loss"][k] - v) / abs(v) for k, v in want["loss"].items()))
    return worst


def _checkpoint_round_trip(trainer) -> None:
    """Save the trained state (in the strategy's drawn ``checkpoint_format``), overwrite every parameter, and
    load it back: the comparison with the reference that follows then checks the checkpoint too, under the
    drawn layout."""
    import shutil
    import tempfile

    import torch.distributed as dist

    root = [tempfile.mkdtemp(prefix="fuzz_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    path = f"{root[0]}/step.ckpt"
    trainer.save_checkpoint(path)
    with torch.no_grad():
        for p in trainer.lightning_module.parameters():
            p.add_(1.0)  # a DTensor shard or a replica alike
    trainer.strategy.load_checkpoint(path)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0], ignore_errors=True)
