"""The self-test: before the first step, the user's model as parallelized against the same model with sequence
parallelism off, on a short probe, on the real devices, kernels and library versions.

Why: every exactness figure of this package was measured on CPU, with test models, on the library versions CI
installed. A user runs other kernels (cuDNN, flash-attn, fla, mamba-ssm), another transformers, and a model
that may mix tokens where no swap can see it (a token shift inside an MLP). The self-test makes "exact or
refused" hold where the user runs.

What runs, on every rank together, once (``UlyssesFPDTStrategy(self_test=...)`` calls :func:`run_self_test`
with the first training batch, before its forward):

* **The probe** ``(b', N)``: up to two rows of the batch's own tokens, ``N = P x L`` with ``L`` local tokens per
  rank: two FPDT chunks per rank (a probe chunk of ``max(8, halo)`` tokens, at most the configured one), else
  ``2 x max(4, halo)`` (each ring rank's two zigzag runs then hold a conv's halo), so the probe crosses every
  shard edge, two chunk edges per rank, every ring step and the hybrids' halos. When the batch packs
  documents, the probe packs two, its edge inside a shard (the second document's first label ignored, so a
  document never predicts the next one's first token). The first two labels are ignored too.
* **Parallel**: ``shard_batch`` of the probe through the model as parallelized (its kernels, FPDT chunking and
  offload, ring, TP, FSDP2, activation checkpointing, LoRA, the precision plugin's autocast): the loss, the
  gradient of the loss with respect to the input embeddings (``torch.autograd.grad``: no parameter's ``.grad``
  is touched; it reaches every layer's backward) and the logits, gathered to the whole sequence.
* **Reference**: the same model inside :func:`~lightning_longctx.integrations.transformers.sequence_parallel_off`
  on the whole probe, on each rank (transformers' own attention, masks, loss, MLPs and mixers; TP and FSDP2 as
  they are). Packed documents: each document run alone (the package's semantics: a packed row equals its documents).
* **Compared**: relative errors ``max|a - b| / max|b|`` of the logits, the input-embedding gradient, and the
  loss, against a tolerance of the compute dtype (:data:`TOLERANCE`).

On a mismatch (any rank; one all-reduce decides), both runs go again without gradients with hooks on every
submodule, and the first module whose inputs agree but whose output does not is named. Nothing has changed
then: no parameter, gradient, optimizer state or data position; the strategy raises :class:`SelfTestFailed`.
On a match nothing is left behind: the RNG states, the buffers, dropout and the contexts' batch are restored.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_longctx.attention.dispatch import with_layout
from lightning_longctx.config import Mode, ResolvedConfig
from lightning_longctx.integrations.context import BatchPositions, SequenceParallelContext
from lightning_longctx.integrations.transformers import sequence_parallel_off
from lightning_longctx.parallel.comm import Group, all_gather_object, all_reduce_no_grad
from lightning_longctx.parallel.sharding import IGNORE_INDEX, document_ids, gather_sequence, shard_batch

#: The relative error (``max|a - b| / max|b|``) the parallel run may show against the reference, by compute
#: dtype; set from the noise floors measured over the architecture sweep (``python tests/arch_sweep.py`` prints
#: them; docs/user_guide.md, "the self-test"): float32 5.5e-7 at most (tolerance 1e-4, the sweep's own bar for
#: "exact"); bf16 3.0e-2 at P = 2 and 1.9e-1 at P = 4 (Falcon-Mamba's input gradient: its dt RMSNorm of small
#: values amplifies bf16 rounding), tolerance 5e-1: the bf16 check catches gross kernel failures (NaN, a wrong
#: log-sum-exp), the float32 check the layout; float64 1.1e-7, not 1e-15, since the hybrids' kernels compute in
#: float32 inside (tolerance 1e-5, the packed sweep's bar). fp16, 3 more mantissa bits than bf16: 1e-1.
#: Layout errors show 8.7e-3 and more in float32 (``tests/test_self_test.py``).
TOLERANCE = {
    torch.float64: 1e-5,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-1,
    torch.float16: 1e-1,
}

#: What the self-test compares, in the order of the message.
QUANTITIES = ("logits", "input_grad", "loss")


class SelfTestFailed(RuntimeError):
    """The model as parallelized does not compute what it computes with sequence parallelism off; ``report``
    holds the measured errors (the same on every rank)."""

    def __init__(self, message: str, report: SelfTestReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class ProbeShape:
    """``length`` ``N`` tokens, ``chunk`` FPDT tokens per chunk per rank (``None``: Ulysses), ``document_edge``
    the first position of the second document (``None``: one document per row)."""

    length: int
    chunk: int | None
    document_edge: int | None


def probe_shape(config: ResolvedConfig, halo: int, packed: bool) -> ProbeShape:
    """The probe of the module docstring for ``config`` and a model whose mixers need ``halo`` tokens."""
    sp, c = config.sp, config.settings.fpdt_chunk_size
    if config.mode is Mode.FPDT and c is not None:
        chunk = min(c, max(8, halo))
        local = 2 * chunk * -(-8 // (2 * chunk))  # at least two chunks and 8 tokens per rank
    else:
        chunk, local = None, 2 * max(4, halo)
    n = sp * local
    # inside the second rank's first chunk (or the middle of a one-rank probe), never on a shard edge
    edge = (local + max(1, (chunk or local) // 2)) if sp > 1 else n // 2 + 1
    return ProbeShape(length=n, chunk=chunk, document_edge=edge if packed else None)


def make_probe(
    batch: Mapping[str, Any], shape: ProbeShape, ignore_index: int = IGNORE_INDEX
) -> dict[str, Tensor]:
    """``input_ids``, ``labels`` ``(b', N)`` from the batch's first rows (repeated to ``N`` tokens), and
    ``position_ids`` of two documents when ``shape.document_edge`` is set."""
    ids = batch["input_ids"][:2]
    reps = -(-shape.length // ids.shape[1])
    ids = ids.repeat(1, reps)[:, : shape.length].contiguous()
    labels = ids.clone()
    labels[:, :2] = ignore_index
    probe = {"input_ids": ids, "labels": labels}
    edge = shape.document_edge
    if edge is not None:
        pos = torch.arange(shape.length, device=ids.device)
        pos[edge:] -= edge
        probe["position_ids"] = pos.expand_as(ids).contiguous()
        labels[:, edge] = ignore_index
    return probe


def compute_dtype(precision: str, model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: the precision plugin's low dtype, else its parameters'."""
    if "bf16" in precision:
        return torch.bfloat16
    if "16" in precision:
        return torch.float16
    param = next(model.parameters(), None)
    return torch.float32 if param is None or not param.is_floating_point() else param.dtype


def checks_for(
    precision: str,
    model: nn.Module,
    autocast: Callable[[], AbstractContextManager[Any]],
    fp32_layout: bool,
    device: torch.device,
) -> list[tuple[torch.dtype, Callable[[], AbstractContextManager[Any]]]]:
    """The precisions to compare in, each with its autocast: the run's own compute dtype (its kernels); and
    before it, when that is a 16-bit dtype over float32 parameters (``fp32_layout``: a ``*-mixed`` precision
    whose parameters stay float32, i.e. not FSDP2's low ``param_dtype``), float32 with autocast off, where a
    layout error stands out of the noise by three orders more (bf16's own noise hides an error of 2e-2)."""
    dtype = compute_dtype(precision, model)
    ours = [(dtype, autocast)]
    if dtype in (torch.bfloat16, torch.float16) and fp32_layout:
        return [(torch.float32, lambda: torch.autocast(device.type, enabled=False)), *ours]
    return ours


@dataclass
class Check:
    """One comparison: both runs computing in ``dtype``, their relative ``errors`` (``QUANTITIES``, the worst
    rank's) against ``tolerance``, and where they first diverge (``None``: they agree)."""

    dtype: torch.dtype
    errors: dict[str, float]
    tolerance: float
    divergence: str | None = None

    @property
    def passed(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())

    def summary(self) -> str:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in self.errors.items())
        return f"in {_name(self.dtype)}: {errs} (tolerance {self.tolerance:.0e})"


@dataclass
class SelfTestReport:
    """Per model: its checks (``precisions`` of :func:`checks_for`), the probe and the seconds it took."""

    model_name: str
    probe: ProbeShape
    rows: int
    checks: list[Check] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if not c.passed), None)

    def summary(self) -> str:
        chunk = "" if self.probe.chunk is None else f", FPDT chunk {self.probe.chunk}"
        docs = "" if self.probe.document_edge is None else ", 2 packed documents"
        return (
            f"{self.model_name} on a probe of {self.rows} x {self.probe.length} tokens{chunk}{docs}, relative "
            "errors " + "; ".join(c.summary() for c in self.checks)
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def relative_error(got: Tensor, ref: Tensor) -> float:
    """``max|got - ref| / max|ref|`` in float64 (``inf`` when the shapes differ or ``got`` is not finite)."""
    if got.shape != ref.shape:
        return float("inf")
    got, ref = got.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return (got - ref).abs().max().item() / max(scale, 1e-30) if ref.numel() else 0.0


# ---- leaving no trace ----
class _ModuleState:
    """What a forward may change on a module besides its parameters: its buffers (the tensor objects and their
    values: a dynamic RoPE registers a NEW ``inv_freq`` for another length) and its plain public attributes
    (numbers, flags, tensors: the same RoPE's ``max_seq_len_cached``), restored as they were."""

    _PLAIN = (bool, int, float, str, Tensor, type(None))

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.buffers = {
            name: (b, None if b is None else b.detach().clone()) for name, b in module._buffers.items()
        }
        self.attrs = {
            k: v for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, self._PLAIN)
        }

    def restore(self) -> None:
        m = self.module
        for name in set(m._buffers) - set(self.buffers):
            del m._buffers[name]
        with torch.no_grad():
            for name, (b, value) in self.buffers.items():
                m._buffers[name] = b
                if b is not None:
                    b.copy_(value)
        for k in [k for k in vars(m) if not k.startswith("_") and k not in self.attrs]:
            if isinstance(vars(m)[k], self._PLAIN):
                del m.__dict__[k]
        m.__dict__.update(self.attrs)


@contextmanager
def _no_trace(
    models: list[nn.Module], contexts: list[SequenceParallelContext], device: torch.device
) -> Iterator[None]:
    """Every state a forward could move comes back: the CPU and device RNGs, every module's buffers and plain
    attributes (running statistics, a rotary cache), the contexts' batch and counters; dropout is off meanwhile
    (both runs would draw masks of different shapes)."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    modules = [_ModuleState(m) for model in models for m in model.modules()]
    dropouts = [
        (m, m.p) for model in models for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)
    ]
    fields = ("positions", "call_position_ids", "attention_calls", "mixer_calls")
    state = [(ctx, {f: getattr(ctx, f) for f in fields}) for ctx in contexts]
    for m, _ in dropouts:
        m.p = 0.0
    try:
        yield
    finally:
        for m, p in dropouts:
            m.p = p
        for saved in modules:
            saved.restore()
        for ctx, values in state:
            for f, v in values.items():
                setattr(ctx, f, v)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@contextmanager
def _probe_chunk(ctx: SequenceParallelContext, chunk: int | None) -> Iterator[None]:
    """The context's FPDT chunk set to the probe's for the parallel run: its config, and its attention rebound to
    that layout (the attention binds its layout when the model is patched)."""
    config, attend = ctx.config, ctx.attend
    if chunk is not None and chunk != config.settings.fpdt_chunk_size:
        ctx.config = dataclasses.replace(
            config, settings=dataclasses.replace(config.settings, fpdt_chunk_size=chunk)
        )
        ctx.attend = with_layout(attend, ctx.config.sequence_layout)
    try:
        yield
    finally:
        ctx.config, ctx.attend = config, attend


class _EmbeddingLeaf:
    """A forward hook on the input embedding that hands the model a leaf with ``requires_grad`` in place of
    the embedding's output: the gradient with respect to it reaches every layer's backward and no parameter's
    ``.grad`` (the embedding's own weight never sees the probe)."""

    def __init__(self, model: nn.Module) -> None:
        self.leaves: list[Tensor] = []
        self.handle = model.get_input_embeddings().register_forward_hook(self)

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        leaf = output.detach().requires_grad_(True)  # a DTensor stays one (tensor parallelism)
        self.leaves.append(leaf)
        return leaf

    def remove(self) -> None:
        self.handle.remove()


@dataclass
class _Run:
    """One side's results on the whole probe: ``logits`` ``(b', N, V)``, ``input_grad`` ``(b', N, hidden)``,
    ``loss`` 0-d."""

    logits: Tensor
    input_grad: Tensor
    loss: Tensor


def _full(x: Tensor) -> Tensor:
    """A DTensor's whole value (tensor parallelism: vocabulary-split logits), detached, in float32."""
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach().float()


def _logits(out: Any) -> Tensor | None:
    logits = getattr(out, "logits", None)
    return None if logits is None else _full(logits)


@dataclass
class _Probe:
    """What both runs need: the model, its context, the probe, its layout, the autocast."""

    model: nn.Module
    ctx: SequenceParallelContext
    probe: dict[str, Tensor]
    shape: ProbeShape
    group: Group
    ring: int
    ignore_index: int
    autocast: Callable[[], AbstractContextManager[Any]]

    def shard(self) -> dict[str, Tensor]:
        return shard_batch(
            self.probe,
            group=self.group,
            chunk_size=self.shape.chunk,
            ignore_index=self.ignore_index,
            ring=self.ring,
        )

    def record(self, shard: Mapping[str, Tensor]) -> None:
        """The probe's positions on the context, as the strategy records a batch's (its documents, once)."""
        full = self.probe.get("position_ids", _arange(self.probe))
        self.ctx.positions = BatchPositions(local=shard["position_ids"], full=full, length=None)

    def gather(self, x: Tensor) -> Tensor:
        return gather_sequence(x.detach(), group=self.group, chunk_size=self.shape.chunk, ring=self.ring)

    def documents(self) -> list[slice]:
        edge = self.shape.document_edge
        n = self.shape.length
        return [slice(0, n)] if edge is None else [slice(0, edge), slice(edge, n)]

    # -- the parallel run --
    def parallel(self) -> _Run:
        shard = self.shard()
        self.record(shard)
        leaf = _EmbeddingLeaf(self.model)
        try:
            with _probe_chunk(self.ctx, self.shape.chunk), self.autocast():
                out = self.model(**shard)
                (grad,) = torch.autograd.grad(out.loss, leaf.leaves[0])
                logits = _logits(out)
                if logits is None:  # FPDT's chunked loss keeps no logits: one forward without labels
                    with torch.no_grad():
                        unlabelled = {k: v for k, v in shard.items() if k not in ("labels", "shift_labels")}
                        logits = _logits(self.model(**unlabelled))
        finally:
            leaf.remove()
        return _Run(self.gather(logits), self.gather(_full(grad)), _full(out.loss))

    # -- the reference run --
    def reference(self) -> _Run:
        """Each document of the probe alone, the loss the documents' token-weighted mean (their first labels
        are ignored: nothing crosses an edge)."""
        leaf = _EmbeddingLeaf(self.model)
        logits, losses, counts = [], [], []
        try:
            with sequence_parallel_off(self.model), self.autocast():
                for doc in self.documents():
                    labels = self.probe["labels"][:, doc]
                    out = self.model(input_ids=self.probe["input_ids"][:, doc], labels=labels)
                    logits.append(_logits(out))
                    losses.append(out.loss)
                    counts.append(int((labels[:, 1:] != self.ignore_index).sum()))
                total = max(sum(counts), 1)  # a document without a target adds nothing (its own mean is NaN)
                loss = sum(part * (c / total) for part, c in zip(losses, counts) if c)
                grads = torch.autograd.grad(loss, leaf.leaves, allow_unused=True)
                grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaf.leaves)]
        finally:
            leaf.remove()
        return _Run(torch.cat(logits, 1), torch.cat([_full(g) for g in grads], 1), _full(loss))


def _arange(probe: Mapping[str, Tensor]) -> Tensor:
    ids = probe["input_ids"]
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


# ---- finding the first module that diverges ----
def _sequence_tensors(value: Any, length: int, prefix: str = "") -> dict[str, Tensor]:
    """The tensors in ``value`` (nested tuples, lists, dicts, model outputs) whose dim 1 is the sequence."""
    if isinstance(value, Tensor):
        if value.dim() >= 2 and value.shape[1] == length and value.is_floating_point():
            return {prefix: value.detach()}
        return {}
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    else:
        return {}
    found: dict[str, Tensor] = {}
    for key, item in items:
        found.update(_sequence_tensors(item, length, f"{prefix}.{key}"))
    return found


class _Recorder:
    """Forward hooks on every submodule of a model: each module's first call, its sequence-shaped inputs and
    outputs (local to this rank), in the order the modules finish."""

    def __init__(self, model: nn.Module, length: int) -> None:
        self.length = length
        self.records: dict[str, tuple[dict[str, Tensor], dict[str, Tensor]]] = {}
        self.handles = [
            module.register_forward_hook(self._hook(name), with_kwargs=True)
            for name, module in model.named_modules()
            if name
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if name not in self.records:
                inputs = {
                    **_sequence_tensors(args, self.length, "arg"),
                    **_sequence_tensors(kwargs, self.length, "kw"),
                }
                self.records[name] = (
                    {k: v.float().cpu() for k, v in inputs.items()},
                    {k: v.float().cpu() for k, v in _sequence_tensors(output, self.length, "out").items()},
                )

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def first_divergence(p: _Probe, tolerance: float) -> str:
    """Both runs again, without gradients, recorded module by module: the first module (in the order they
    finish in the parallel run) whose recorded inputs agree and whose output does not. Every rank calls it."""
    shard = p.shard()
    unlabelled = {k: v for k, v in shard.items() if k not in ("labels", "shift_labels")}
    local = shard["input_ids"].shape[1]
    rec = _Recorder(p.model, local)
    try:
        with torch.no_grad(), _probe_chunk(p.ctx, p.shape.chunk), p.autocast():
            p.record(shard)
            p.model(**unlabelled)
    finally:
        rec.remove()
    # the shards of every record to the whole sequence: the same records, in the same order, on every rank
    parallel = {
        name: tuple(
            {k: p.gather(v.to(shard["input_ids"].device)).cpu() for k, v in part.items()} for part in rec_
        )
        for name, rec_ in rec.records.items()
    }
    runs = []
    with torch.no_grad(), sequence_parallel_off(p.model), p.autocast():
        for doc in p.documents():
            rec = _Recorder(p.model, doc.stop - doc.start)
            try:
                ids = p.probe["input_ids"][
                    :, doc
                ]  # positions of every row: outputs shaped as the parallel run's
                p.model(input_ids=ids, position_ids=_arange({"input_ids": ids}))
            finally:
                rec.remove()
            runs.append(rec.records)

    def reference(name: str, part: int, key: str) -> Tensor | None:
        pieces = [run.get(name, ({}, {}))[part].get(key) for run in runs]
        return None if any(x is None for x in pieces) else torch.cat(pieces, 1)

    first_bad = None
    for name, (inputs, outputs) in parallel.items():
        out_err = max(
            (relative_error(v, r) for k, v in outputs.items() if (r := reference(name, 1, k)) is not None),
            default=0.0,
        )
        if out_err <= tolerance:
            continue
        in_err = max(
            (relative_error(v, r) for k, v in inputs.items() if (r := reference(name, 0, k)) is not None),
            default=0.0,
        )
        if in_err <= tolerance:
            return (
                f"{name} (its inputs agree; its output differs by {out_err:.1e}, tolerance {tolerance:.0e})"
            )
        first_bad = first_bad or name
    if first_bad is not None:
        return f"{first_bad} (the first module whose output differs; its inputs differ too)"
    return "no module's forward output differs: the backward does (the input-embedding gradient)"


def synthetic_batch(
    model: nn.Module, device: torch.device, rows: int = 2, length: int = 64
) -> dict[str, Tensor]:
    """``input_ids`` ``(rows, length)`` drawn from the model's vocabulary by a generator of its own (the
    global RNG is not touched): the probe's tokens where no batch is at hand yet (the strategy's float32 check
    before FSDP2 shards the model, whose low ``param_dtype`` leaves no float32 run after it)."""
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 2)
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, max(vocab, 2), (rows, length), generator=g).to(device)}


# ---- the test ----
def run_self_test(
    models: list[nn.Module],
    contexts: list[SequenceParallelContext],
    batch: Mapping[str, Any],
    *,
    config: ResolvedConfig,
    group: Group,
    precision: str,
    autocast: Callable[[], AbstractContextManager[Any]],
    device: torch.device,
    fp32_layout: bool = True,
    packed: bool | None = None,
) -> list[SelfTestReport]:
    """Run the self-test of every patched model (``models`` with their ``contexts``) on a probe made from
    ``batch`` (the first training batch, whole: ``(b, N)``). Every rank calls it with its own batch; the
    verdict is the same on every rank (one all-reduce). Raises :class:`SelfTestFailed` on a mismatch.
    ``autocast``: the precision plugin's context; ``fp32_layout``: the parameters stay float32 under a 16-bit
    ``precision`` (:func:`checks_for`); ``packed``: whether the probe packs two documents (``None``: when the
    batch does)."""
    reports = []
    ids = batch["input_ids"]
    positions = batch.get("position_ids")
    if (
        packed is None
    ):  # one answer on every rank: FSDP2 gathers over data-parallel ranks of other batches, and
        # a packed probe runs its reference once per document
        mine = (
            isinstance(positions, Tensor)
            and document_ids(positions.reshape(-1, positions.shape[-1])) is not None
        )
        packed = bool(all_reduce_no_grad(torch.tensor([float(mine)], device=device), op="max")[0])
    ignore_index = config.settings.ignore_index
    # TF32 off throughout: its 1e-3 would hide a layout error of the float32 check
    with _no_trace(models, contexts, device), _full_fp32(), torch.enable_grad():
        for model, ctx in zip(models, contexts):
            start = time.perf_counter()
            shape = probe_shape(config, ctx.mixer_halo, packed)
            p = _Probe(
                model, ctx, make_probe({"input_ids": ids}, shape, ignore_index), shape, group,
                config.dims.ring, ignore_index, autocast,
            )  # fmt: skip
            report = SelfTestReport(ctx.model_name, shape, rows=p.probe["input_ids"].shape[0])
            for dtype, cast in checks_for(precision, model, autocast, fp32_layout, device):
                p.autocast = cast
                check = _compare(p, dtype, device)
                report.checks.append(check)
                if not check.passed:
                    found = first_divergence(p, check.tolerance)
                    check.divergence = next(d for d in all_gather_object(found) if d)
                    break
            report.seconds = time.perf_counter() - start
            reports.append(report)
            if not report.passed:
                raise SelfTestFailed(failure_message(report, config, precision), report)
    return reports


@contextmanager
def _full_fp32() -> Iterator[None]:
    """float32 matmuls and convolutions at full precision (TF32 off): TF32's 1e-3 would hide a layout error."""
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = conv


def _compare(p: _Probe, dtype: torch.dtype, device: torch.device) -> Check:
    """Both runs in ``dtype`` and their errors, the worst rank's on every rank (data-parallel ranks probe
    different tokens)."""
    got, ref = p.parallel(), p.reference()
    errors = [relative_error(getattr(got, q), getattr(ref, q)) for q in QUANTITIES]
    worst = all_reduce_no_grad(torch.tensor(errors, dtype=torch.float64, device=device), op="max")
    return Check(dtype, dict(zip(QUANTITIES, worst.tolist())), TOLERANCE.get(dtype, TOLERANCE[torch.float32]))


def failure_message(report: SelfTestReport, config: ResolvedConfig, precision: str) -> str:
    return (
        f"UlyssesFPDTStrategy self-test failed before the first step: {report.model_name} as parallelized "
        f"({config}, precision={precision!r}, attention_backend={config.settings.attention_backend!r}) does not "
        f"compute what it computes with sequence parallelism off. {report.summary()}. First diverging module "
        f"(in {_name(report.failed.dtype)}): {report.failed.divergence}. Nothing has changed: no parameter, optimizer state or data position. The model "
        "mixes tokens in a way the sequence-parallel swap does not reproduce (or a kernel of this device is "
        "wrong): train it without sequence parallelism (sequence_parallel_size=1), or report the model with "
        "this message. self_test=False skips the check and trains with the difference."
    )
