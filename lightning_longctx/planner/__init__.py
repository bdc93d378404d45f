"""The memory planner: the bytes one training step needs per device and per host, before you launch it.

:func:`plan_memory` models one steady-state training step (forward, backward, optimizer step) of a
Hugging Face decoder LM under :class:`~lightning_longctx.UlyssesFPDTStrategy`, from the model config
and the strategy's settings alone (no weights, no GPU). :func:`longest_sequence` searches the longest
sequence whose plan fits a device (and a host) memory size. ``lightning-longctx plan --config my.yaml``
prints both for a LightningCLI config.

The model follows the code of this package and of PyTorch/transformers tensor by tensor (checked
against a step's allocations with the PyTorch profiler and against peak RSS; docs/benchmarks.md).
Per rank, with ``t = micro_batch_size * N / P`` local tokens, ``d, L, H, H_kv, hd, I, V`` the
config's dims, ``w`` the (master) parameter bytes, ``pw`` the bytes of the parameters the compute reads
(FSDP2's MixedPrecisionPolicy: bf16 over fp32 master weights under ``fsdp`` + ``bf16-mixed``; else ``w``),
``m`` the matmul (autocast) bytes, ``r`` the residual stream's bytes (the embedding's dtype):

* **weights** ``= n_params * w`` (``/ (dp*sp)`` with FSDP; LoRA adapters included); **gradients** and
  **optimizer state** (2 AdamW states, in the parameter dtype) of the trainable parameters only (LoRA: the
  adapters, the frozen base has none); with ``cpu_offload`` (FSDP2's CPUOffloadPolicy) all three are on the
  host and the optimizer step runs there. DDP: the gradients are views into its all-reduce buckets (the
  strategy sets ``gradient_as_bucket_view=True``), allocated for the whole run, so they show as **DDP
  gradient buckets** in every phase; FSDP: the unsharded root parameters (embedding, head, final norm)
  for the step, two unsharded blocks (current + prefetched), in ``pw``, and in backward one block's
  unsharded gradients with their reduce-scatter input (``w``: fp32 under the policy) and the root's.
* **activations kept for backward**, per layer per token: two RMSNorms ``2 * (4 + r) * d`` (fp32 input,
  normalised copy; FPDT tiles the norms: ``2 * r * d``, their input only); the projections' inputs (``d*m``
  each; under autocast each of q/k/v and gate/up keeps its own cast copy); attention in head layout after
  the all-to-all: q, k, v, out ``(2H + 2H_kv') * hd`` and the fp32 log-sum-exp ``4H`` (FPDT: the same per
  chunk, in host memory with offload; its blocks run in the autocast dtype, the lse too); the o_proj input
  ``H*hd*m``; the MLP's gate, act, up, act*up ``4*I*m`` (none when FPDT tiles it). With activation
  checkpointing only each layer's input ``d*r``, and one layer is recomputed in backward; FPDT's offloaded
  chunks are saved tensors, so the checkpoint drops them after each layer's forward and the recompute
  rebuilds them: the host holds the running layer's in forward, the recomputed layer's in backward. With
  ``activation_offload`` those layer inputs are on the host; the device holds the one being recomputed
  and the next one prefetched in backward, and the running one in forward. Plus
  the final norm, the head's input (both freed in the loss backward), the batch and the RoPE tables.
* **loss working set**: Ulysses (Hugging Face's loss) ``t*V`` fp32 log-softmax + its gradient + the
  logits' gradient (``12*t*V`` bytes at the start of backward); FPDT's chunked lm_head + loss: one
  fp32 ``(loss_chunk, V)`` block (two with a soft-cap; plus its matmul-dtype original and copy under
  autocast), the head's fp32 gradient accumulator and the hidden states' gradient; ``loss_chunk``
  defaults to 128 MiB per block (``chunked_loss.default_loss_chunk_size``).
* **attention / MLP working sets, all-to-all buffers**: one layer's transient tensors in forward and
  backward (Ulysses: the gradients of q, k, v and the all-to-all copies, O(t); FPDT: one chunk's
  segment, one ``(H/P, 1024, 1024)`` score tile, the double-buffered kv prefetch with offload, and the
  layer's q/k/v gradients).

* **tensor parallelism** (``tensor_parallel_size = tp``, FSDP only; the world is dp x sp x tp): one rank
  holds the shards of the model's Hugging Face TP plan (q/k/v, gate/up and MoE experts' packed gate/up
  column-wise, o_proj/down row-wise: ``/ tp``; a row-wise bias, the embedding, norms, Qwen3's q/k norms and a
  MoE router whole), FSDP shards that over dp x sp, and its unsharded blocks are the TP-local ones. The
  lm_head splits over the vocabulary only in FPDT mode, untied and ``V % tp == 0``: the chunked loss then
  runs on ``(loss_chunk, V/tp)`` blocks with a ``(V/tp, d)`` fp32 head gradient and an fp32 hidden-state
  gradient (summed over tp), else it is replicated (Ulysses: full logits). Activations of hidden width (the
  residual stream, the norms, the o/down projections' outputs, the checkpointed layer inputs) are replicated
  over tp; those per head (q/k/v, out, lse, the o_proj input, the all-to-all buffers, the attention working
  set: ``H/tp`` heads before the sp split) and the MLP's intermediates are ``/ tp``.

* **Ulysses x ring** (``ring_size = r``, Ulysses mode; ``"auto"``: ``config.auto_ring_size``): the all-to-all
  runs over ``U = P / r`` ranks (kv heads copied for U, not P) and each rank holds ``b * N / r`` tokens of
  ``H / U`` heads in head layout (its q/k/v/out/lse: as many as Ulysses' ``N / P`` tokens of ``H`` heads); the
  sequence pads to ``2P``. **ring buffers**: two k/v blocks of ``2 * b * (N/r) * (H_kv'/U) * hd`` elements in
  flight in forward; in backward the visiting k/v block(s) and three fp32 dk/dv blocks (accumulating, sent,
  received). The attention working set adds the fp32 output accumulator and one kernel call's merge in forward
  (a call: a zigzag chunk of ``N / 2r`` rows), and dout, ``delta``, the fp32 dq accumulator and two calls' fp32
  dq/dk/dv in backward (``terms._ring_forward_moment`` / ``_ring_backward_moment``: the largest moments of
  ``attention/ring.py``'s loop, equal to a real ring's live tensor bytes, tests/test_planner.py).

* **FPDT x ring** (``fpdt_chunk_size = c`` with ``ring_size = r``; ``attention/fpdt_ring.py``): ``K = N / (r U
  c)`` local segments of ``S = U c`` tokens per rank (``c`` capped at ``N / 2P``, the sequence padded to ``2 P
  c``). The store (q, stacked k/v in q's dtype, out, fp32 lse; dout and delta in backward) is the activations'
  FPDT chunks, on the host with offload. **ring buffers**: the ``arriving`` store of the next step's k/v block
  ``2 * b * (N/r) * (H_kv'/U) * hd`` (and the visiting one beside it when r > 2), on the device, or with
  offload on the host less the segment being received, with two k/v segments on the device; in backward also
  the visiting segment's fp32 dk/dv and the K dk/dv passes one hop behind (send + receive: two fp32 dk/dv
  blocks) and the last received dk/dv segment. The attention working set: the fp32 out/lse accumulators of all
  K segments, one unit's fp32 output and merge, FPDT's score tile (forward; or at its end the outputs and
  their concatenation, when larger); the output's gradient, the fp32 dq accumulators, one unit's and the
  previous unit's fp32 dq/dk/dv, two score tiles (backward) (``terms._fpdt_ring_forward_moment`` /
  ``_fpdt_ring_backward_moment``: equal to a real ``fpdt_ring_attention``'s live tensor bytes but the math
  score tile, tests/test_planner.py).
* **hybrids under a ring**: the recurrent layers' scan runs over two zigzag halves of ``N / 2P`` tokens per
  rank in Ulysses x ring (``2P`` segments), over the FPDT chunks in FPDT x ring (``P * K``); the state
  exchange buffers count those segments.

* **hybrid models** (layer kinds from ``config.layer_types`` / ``layers_block_type``, or the model type when
  attention-free): gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid) and Mamba-2 layers (Mamba2, Bamba,
  Falcon-H1, whose layers run attention and Mamba-2 side by side; Granite-4 hybrid and Nemotron-H as far as
  they are not mixture-of-experts configs, which are refused) keep their
  own activations instead of attention's; the attention terms count the attention layers only, and Mamba-2
  blocks have no MLP. Per token, what HF's torch fallbacks save (``_gdn_token_bytes`` /
  ``_mamba2_token_bytes``, within 10 % of a measured mixer forward, tests/test_planner.py), with the package's
  state-passing adapters: the projections' inputs, the conv's input and output, fp32 copies of q/k/v (x, B,
  C) and their chunked forms, ``5 * heads * 64`` (GDN; Mamba-2: ``3 * heads * chunk``) fp32 intra-chunk
  matrix entries, one state per chunk (GDN: ``heads * dk * (dv + dk)`` with the identity columns), the gated
  norm and out_proj inputs. These layers have no all-to-all: their **state exchange buffers** are the
  all-gathered fp32 per-segment summaries (GDN ``heads * dk * (dk + dv)``, Mamba-2 ``heads * (1 + p * n)``
  per segment, ``P`` segments, ``P * chunks`` with FPDT). With checkpointing the heaviest layer kind is the
  one recomputed.

The peak is the largest of five phases: the last layer's forward and the loss forward (with the
previous step's gradients still allocated: Lightning frees them between forward and backward), the
loss backward, the last layer's backward, and the optimizer step. A layer phase is the larger of its
attention moment and its MLP moment (the layer's MLP tensors do not exist yet, or are freed, while its
attention runs). Each component is shown with its device bytes in the peak phase, so the rows add up to
the total; ``largest`` is its maximum at any moment, its host bytes the most it holds on the host in any
phase.

Fitting: :attr:`MemoryPlan.fits` compares ``device_total`` plus a reserve (``CUDA_CONTEXT_BYTES``, 1 GiB for
the CUDA context and cuBLAS / NCCL workspaces, none with ``device_type="cpu"``, plus ``ALLOCATOR_RESERVE``, 5 %
of the peak for the allocator's slack; ``device_reserve=`` to change it) with ``device_memory``, and
``devices_per_host`` ranks' host peak plus ``HOST_PROCESS_BYTES`` each (4 GiB: the process, its data loader)
with ``host_memory``;
:attr:`MemoryPlan.binding` names the limit with the least room.

In the code, one module per job: ``shapes.py`` reads the model's shape from its config (shared with
:mod:`lightning_longctx.planner.flops`); ``plan.py`` maps :func:`plan_memory`'s keywords onto the strategy's
:class:`~lightning_longctx.config.SequenceParallelConfig` (validated there, once) and resolves it;
``per_rank.py`` turns the shape and the resolved config into a ``_PerRank``, what one rank holds (tokens and
heads per rank, dtype sizes, mode flags), checking the planner's own inputs; ``terms.py`` has one small
function per memory term, returning a ``_Term`` (device bytes, host bytes, the table row it adds to, a note);
``phases.py``'s ``_PHASE_TABLE`` says at which moments each term is alive, and ``evaluate`` sums them and
takes the peak; ``report.py`` is the answer (``MemoryPlan``: its table, JSON, fit). A new memory term is one
function plus one line of the table (README.md).

What it does not model: mixture-of-experts layers (their TP split is counted, ``_count_params``; their
configs are refused), non-RMSNorm norms and fused qkv projections (counted
as Llama's), LoRA's rank-r activations, and gradient accumulation (gradients then persist through
backward: add ``gradients`` to the peak). Hybrids: the recurrent layers' saved bytes are the torch
fallbacks' (fla / mamba-ssm kernels on GPU save far less: the plan is then an upper bound); their backward
working set (gradients of the fp32 chunk tensors) is not counted; the layer phases are the last attention
layer's with every layer's activations alive; tensor parallelism of hybrids, and the recurrent kinds MiniMax
lightning attention, Kimi delta attention, Mamba-1, RG-LRU, RWKV, xLSTM, Zamba2's shared blocks and LFM2's
convolutions are refused with the kind named.

How long a step takes: :func:`estimate_step_time` prices what one rank holds with a device's achieved rates
(``step_time.py``; the device table with its sources in ``devices.py``; a CPU's rates measured by
``benchmarks/calibrate_step_time.py`` and read back with ``devices.load_spec``): step time, tokens/s, MFU
(PaLM's model FLOPs) and HFU (recompute counted), what binds.
"""

from __future__ import annotations

from lightning_longctx.planner.devices import DEVICES, DeviceSpec, device_spec
from lightning_longctx.planner.per_rank import (
    ALL_LINEAR,
    ALLOCATOR_RESERVE,
    CUDA_CONTEXT_BYTES,
    HOST_PROCESS_BYTES,
)
from lightning_longctx.planner.plan import (
    longest_sequence,
    parallel_kwargs,
    plan_memory,
    resolve_parallel,
    step_plan_kwargs,
)
from lightning_longctx.planner.report import MemoryComponent, MemoryPlan, format_bytes, parse_bytes
from lightning_longctx.planner.ring_size import RingChoice, ring_choice
from lightning_longctx.planner.step_time import StepTimeEstimate, estimate_step_time

__all__ = [
    "ALLOCATOR_RESERVE",
    "ALL_LINEAR",
    "CUDA_CONTEXT_BYTES",
    "DEVICES",
    "HOST_PROCESS_BYTES",
    "DeviceSpec",
    "MemoryComponent",
    "MemoryPlan",
    "RingChoice",
    "StepTimeEstimate",
    "device_spec",
    "estimate_step_time",
    "format_bytes",
    "longest_sequence",
    "parallel_kwargs",
    "parse_bytes",
    "plan_memory",
    "resolve_parallel",
    "ring_choice",
    "step_plan_kwargs",
]
