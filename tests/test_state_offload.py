"""Model-state offload (``cpu_offload=True``: FSDP2's ``CPUOffloadPolicy``) and FSDP2 mixed precision under
UlyssesFPDTStrategy, real Trainers on gloo.

Offload must change where the state lives, never a number: every parameter after three AdamW steps equals
the same run without offload (bit for bit on the CPU) and agrees with a single-process AdamW loop as closely
as fp32 allows (``ADAM_TOLERANCE``). On the CPU host and device are the same
memory, so the placement checks here also read the offload policy FSDP2 holds on every sharded module; the
CUDA test at the end (skipped without a GPU) checks the real placement: parameters, gradients and
optimizer state on the host, buffers on the device.

Mixed precision (``data_parallel="fsdp"`` + ``bf16-mixed`` / ``16-mixed``): FSDP2's ``MixedPrecisionPolicy``
over fp32 master weights: low-precision activations, fp32 gradients and optimizer.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from helpers.hf_models import HFModule, TokenDataset, reference_training, tiny_model
from helpers.launch import process_groups
from helpers.lightning import SEQ, lightning_env
from helpers.lora import MODES, SeenPatched, lora_errors, lora_model
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.recipes import CausalLM

CUDA = torch.cuda.is_available()
STEPS = 3
ADAM_LR = 1e-2  # HFModule(adam=True)'s AdamW
#: Against one float64 process. AdamW's first updates are ~lr * sign(g): where a gradient element is near eps,
#: fp32 rounding moves the update at the lr scale, so a plain fp32 loop of the same model is itself 8e-5 from
#: float64 (1e-5 cannot hold for any fp32 run; measured here 1.1e-5 to 1.9e-4). A real error (a lost shard's
#: gradient, reset optimizer state) moves parameters by ~lr, 1e-1 of their size.
ADAM_TOLERANCE = 5e-4
#: FPDT in 3-token chunks (24 tokens: 8, 4 or 2 chunks per rank at sp 1, 2, 4), every layer checkpointed and
#: its input kept on the host
FPDT = {"data_parallel": "fsdp", "fpdt_chunk_size": 3, "activation_offload": True}


class _Probe(L.Callback):
    """What lives where during the fit: the trainable parameters' type/device/dtype and their gradients',
    the optimizer state's devices, FSDP2's policies on every sharded module and a decoder layer's output
    dtype. Read before the strategy's teardown."""

    def __init__(self) -> None:
        self.seen: dict = {"grads": set(), "layer_out": set()}

    @staticmethod
    def _kinds(tensors) -> set:
        return {(type(t).__name__, t.device.type, t.dtype) for t in tensors}

    def on_train_start(self, trainer, pl_module) -> None:
        layer = next(m for m in pl_module.modules() if type(m).__name__.endswith("DecoderLayer"))

        def hook(module, args, out) -> None:  # returns None: the output stays as it is
            self.seen["layer_out"].add((out[0] if isinstance(out, tuple) else out).dtype)

        layer.register_forward_hook(hook)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        self.seen["grads"] |= self._kinds(p.grad for p in trainable if p.grad is not None)

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.fsdp import FSDPModule

        optimizer = trainer.optimizers[0]
        self.seen["params"] = self._kinds(p for p in pl_module.parameters() if p.requires_grad)
        self.seen["optimizer_state"] = {
            (key, v.device.type)
            for state in optimizer.state.values()
            for key, v in state.items()
            if isinstance(v, torch.Tensor)
        }
        self.seen["buffers"] = {b.device.type for b in pl_module.buffers()}
        if torch.cuda.is_available():  # pinning is a CUDA notion
            self.seen["pinned"] = {
                p.to_local().is_pinned() for p in pl_module.parameters() if p.requires_grad
            }
        policies = set()
        for m in pl_module.modules():
            group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
            if group is not None:
                off, mp = group.offload_policy, group.mp_policy
                policies.add(
                    (type(off).__name__, getattr(off, "pin_memory", None), mp.param_dtype, mp.reduce_dtype)
                )
        self.seen["policies"] = policies


def _fit_probe(sp, strategy_kwargs, *, adam=True, precision="32-true", steps=STEPS):
    """One Trainer fit of the tiny Llama (``_fit`` of test_strategy, plus the probe and AdamW): rank 0's
    full state dict (FSDP gathers it there), the losses and what the probe saw."""
    lightning_env()
    world = dist.get_world_size()
    module = HFModule(tiny_model("llama"), dataset=TokenDataset(world // sp * steps, SEQ), adam=adam)
    probe = _Probe()
    plugins = []
    if precision == "16-mixed":  # Lightning turns 16-mixed into bf16-mixed on the CPU: ask for it directly
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins, precision = [MixedPrecision("16-mixed", "cpu")], None
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=sp, **strategy_kwargs),
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        precision=precision,
        plugins=plugins,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, module.losses, probe.seen


def _with_and_without_offload(sp, strategy_kwargs):
    return [_fit_probe(sp, {**strategy_kwargs, "cpu_offload": offload}) for offload in (False, True)]


def _reference_adamw(world, sp, dtype=torch.float32, steps=STEPS):
    """One process, the same global batches in Lightning's sampler order, AdamW: (state dict, losses)."""
    model = tiny_model("llama").to(dtype)
    losses = reference_training(
        model,
        TokenDataset(world // sp * steps, SEQ),
        dp=world // sp,
        batch_size=1,
        steps=steps,
        optimizer=lambda params: torch.optim.AdamW(params, lr=ADAM_LR),
    )
    return {k: v.double() for k, v in model.state_dict().items()}, losses


def _worst(state, ref) -> float:
    assert state.keys() == ref.keys()
    return max(
        float((state[k].double() - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref
    )


def _offloaded(seen, pin_memory=False) -> None:
    """Every sharded module holds FSDP2's CPU offload policy; parameters, gradients and optimizer state are
    CPU DTensors (trivially on a CPU; the policy is what makes them so on a GPU)."""
    assert seen["policies"] and {p[:2] for p in seen["policies"]} == {("CPUOffloadPolicy", pin_memory)}
    assert {(t, d) for t, d, _ in seen["params"]} == {("DTensor", "cpu")}, seen["params"]
    assert {(t, d) for t, d, _ in seen["grads"]} == {("DTensor", "cpu")}, seen["grads"]
    assert {d for _, d in seen["optimizer_state"]} == {"cpu"}
    assert {k for k, _ in seen["optimizer_state"]} >= {"exp_avg", "exp_avg_sq"}


OFFLOAD_CASES = {
    # name: (world, sp, strategy kwargs on top of FPDT)
    "p1": (1, 1, {}),
    "p2_fpdt_offload": (2, 2, {"offload": True}),
    "p4": (4, 4, {}),
    "dp2_sp2": (4, 2, {}),
}


@pytest.mark.parametrize("world,sp,skw", list(OFFLOAD_CASES.values()), ids=list(OFFLOAD_CASES))
def test_cpu_offload_changes_no_parameter(dist_pool, world, sp, skw):
    """Three AdamW steps, FPDT + activation offload: with cpu_offload every parameter equals the run without
    it (relative 1e-6; measured 0) and one float64 process within ADAM_TOLERANCE; the state is on the host."""
    results = dist_pool(world).run(_with_and_without_offload, sp, {**FPDT, **skw})
    (plain, plain_losses, _), (offload, offload_losses, _) = results[0]
    for rank_result in results:
        _offloaded(rank_result[1][2])
        assert {p[0] for p in rank_result[0][2]["policies"]} == {"OffloadPolicy"}  # the default: none
    exact, ref_losses = _reference_adamw(world, sp, torch.float64)
    init = tiny_model("llama").state_dict()
    assert all((exact[k] - init[k]).abs().max() > 0 for k in exact), "a parameter never moved: proves nothing"
    vs_plain, vs_ref = _worst(offload, plain), _worst(offload, exact)
    assert vs_plain <= 1e-6, f"offload vs no offload: {vs_plain:.2e}"
    assert vs_ref <= ADAM_TOLERANCE, f"vs one float64 process: {vs_ref:.2e}"
    assert offload_losses == plain_losses
    if world == sp:  # one data-parallel rank: rank 0's losses are the global batch's
        assert max(abs(a - b) for a, b in zip(offload_losses, ref_losses)) < 1e-5
    print(f"world {world} sp {sp}: offload vs none {vs_plain:.1e}, vs one float64 process {vs_ref:.1e}")


def _fit_lora_offload(arch: str, mode: str):
    """``test_lora._fit_lora`` under data_parallel='fsdp' with cpu_offload, plus the probe."""
    lightning_env()
    module = HFModule(lora_model(arch), dataset=TokenDataset(2, SEQ))
    seen, probe = SeenPatched(), _Probe()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(
            sequence_parallel_size=2, data_parallel="fsdp", cpu_offload=True, **MODES[mode]
        ),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=2,
        callbacks=[seen, probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return (state, module.losses, seen.mode, seen.attention_calls), probe.seen


def test_lora_with_cpu_offload_trains_like_one_process(dist_pool):
    """peft LoRA at sp 2, FPDT, FSDP2 with cpu_offload: the LoRA weights train as on one process (SGD, the
    LoRA tests' reference), the frozen base weights stay bit-identical, the trainable state is on the host."""
    results = dist_pool(2).run(_fit_lora_offload, "llama", "fpdt")
    for _, seen in results:
        assert {p[:2] for p in seen["policies"]} == {("CPUOffloadPolicy", False)}
        assert {(t, d) for t, d, _ in seen["params"] | seen["grads"]} == {("DTensor", "cpu")}
    errors = lora_errors(
        "llama", [fit for fit, _ in results if fit[0]]
    )  # FSDP: the full state on rank 0 only
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, f"{worst}: relative error {errors[worst]:.2e}"


def _resume_with_offload(root):
    """4 AdamW steps straight, and 2 + 2 resumed from a checkpoint, both with cpu_offload (test_strategy's
    _resume): losses and final parameters, and where the restored optimizer state lives."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    lightning_env()
    data = TokenDataset(2, SEQ)  # two epochs of two steps; the checkpoint sits at the epoch boundary

    def fit(seed, steps, ckpt_path=None, callbacks=()):
        module = HFModule(tiny_model("llama", seed=seed), dataset=data, adam=True)
        probe = _Probe()
        trainer = L.Trainer(
            strategy=UlyssesFPDTStrategy(sequence_parallel_size=2, cpu_offload=True, **FPDT),
            accelerator="cpu", devices=2, max_steps=steps, callbacks=[probe, *callbacks], logger=False,
            enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, ckpt_path=ckpt_path)
        return module.losses, trainer.strategy.full_state_dict(), probe.seen

    full_losses, full_state, _ = fit(0, 4)
    ckpt = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
    first_losses, _, _ = fit(0, 2, callbacks=[ckpt])
    dist.barrier()
    second_losses, state, seen = fit(123, 4, ckpt_path=f"{root}/epoch=0-step=2.ckpt")  # must be overwritten
    return full_losses, first_losses + second_losses, full_state, state, seen


def test_checkpoint_resume_with_cpu_offload_continues_exactly(dist_pool, tmp_path):
    """The full optimizer state of a checkpoint is restored onto the host shards (the strategy's FSDP loader,
    never Lightning's, which would move it to the root device) and training continues bit for bit."""
    results = dist_pool(2).run(_resume_with_offload, str(tmp_path))
    assert results[0][2] and results[0][3]
    for full_losses, resumed_losses, full_state, resumed_state, seen in results:
        assert resumed_losses == full_losses
        _offloaded(seen)
        for name, ref in full_state.items():
            assert torch.equal(resumed_state[name], ref), name


# ---- mixed precision ----


MP_TOLERANCE = {"bf16-mixed": 3e-2, "16-mixed": 3e-3}  # measured: 1.0e-2 (bf16), 8.5e-4 (fp16)
LOW = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fsdp_mixed_precision_is_fsdp2_policy(dist_pool, precision):
    """fsdp + bf16-mixed / 16-mixed: FSDP2's MixedPrecisionPolicy(low, reduce fp32) on every sharded module;
    fp32 DTensor master weights and gradients, a low-precision residual stream; sp 2 matches sp 1 with the
    same policy within the low dtype's tolerance (SGD: the update is the gradient, not its sign)."""
    skw = {"data_parallel": "fsdp", "fpdt_chunk_size": 4}
    one = dist_pool(1).run(_fit_probe, 1, skw, adam=False, precision=precision)[0]
    two = dist_pool(2).run(_fit_probe, 2, skw, adam=False, precision=precision)
    for _, _, seen in [one, *two]:
        assert seen["policies"] == {("OffloadPolicy", None, LOW[precision], torch.float32)}
        assert seen["params"] == {("DTensor", "cpu", torch.float32)}
        assert seen["grads"] == {("DTensor", "cpu", torch.float32)}
        assert seen["layer_out"] == {LOW[precision]}
    err = _worst(two[0][0], one[0])
    assert err < MP_TOLERANCE[precision], f"sp 2 vs sp 1 under {precision}: {err:.2e}"
    print(f"{precision}: sp 2 vs sp 1 {err:.1e}")


def test_ddp_mixed_precision_keeps_autocast_only(dist_pool):
    """ddp + bf16-mixed is unchanged: plain fp32 parameters under Lightning's autocast, fp32 residual stream."""
    for _, _, seen in dist_pool(2).run(_fit_probe, 2, {}, adam=False, precision="bf16-mixed", steps=1):
        assert seen["params"] == {("Parameter", "cpu", torch.float32)}
        assert seen["layer_out"] == {torch.float32}
        assert not seen["policies"]


def _grad_scaler_skips_on_every_rank():
    """GradScaler over FSDP2's sharded gradients: an inf in rank 0's shard only is found on every rank (DTensor
    reduces found_inf over the mesh), so every rank skips the same step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # a mesh over the world: the default group on CPU, a group of its own on a CUDA machine
    with process_groups() as own:
        mesh = own(init_device_mesh("cpu", (dist.get_world_size(),)))
        param = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        grad = torch.ones(4, 2)
        grad[0, 0] = float("inf")  # row 0 is rank 0's
        param.grad = distribute_tensor(grad, mesh, [Shard(0)])
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))  # as Lightning's backward does
        scaler.step(optimizer)  # unscales (finding the inf), then skips the step
        scaler.update()
        return scaler.get_scale(), param.full_tensor()


def test_16_mixed_grad_scaler_agrees_across_ranks(dist_pool):
    for scale, param in dist_pool(2).run(_grad_scaler_skips_on_every_rank):
        assert scale == 2.0, "the scale backs off on every rank"
        assert torch.equal(param, torch.ones(4, 2)), "a step ran on a rank that should have skipped it"


# ---- settings ----


def test_cpu_offload_needs_fsdp():
    with pytest.raises(
        ValueError, match=r"cpu_offload=True with data_parallel='ddp'.*set data_parallel='fsdp'"
    ):
        UlyssesFPDTStrategy(cpu_offload=True)
    with pytest.raises(ValueError, match="cpu_offload='yes': use True or False"):
        UlyssesFPDTStrategy(data_parallel="fsdp", cpu_offload="yes")
    assert UlyssesFPDTStrategy(data_parallel="fsdp", cpu_offload=True).sp_config.cpu_offload


@pytest.mark.parametrize(
    "cpu_offload,given,expected",
    [
        (True, None, "cuda:nccl,cpu:gloo"),
        (True, "nccl", "cuda:nccl,cpu:gloo"),
        (True, "cuda:nccl,cpu:gloo", "cuda:nccl,cpu:gloo"),
        (False, None, "nccl"),
    ],
)
def test_cpu_offload_adds_a_cpu_backend_on_gpus(cpu_offload, given, expected):
    """The sharded gradients live on the host: clipping reduces their norm over CPU tensors, which NCCL
    cannot, so the process group gets a gloo backend for the CPU (as torchtitan does)."""
    strategy = UlyssesFPDTStrategy(data_parallel="fsdp", cpu_offload=cpu_offload, process_group_backend=given)
    strategy.parallel_devices = [torch.device("cuda", 0)]
    assert strategy._get_process_group_backend() == expected


@pytest.mark.parametrize("cpu_offload", [True, False])
def test_cpu_offload_builds_the_model_on_the_host(cpu_offload):
    """configure_model runs in the strategy's tensor_init_context: on the root device, but on the host under
    cpu_offload (the whole model never sits on the device)."""
    strategy = UlyssesFPDTStrategy(data_parallel="fsdp", cpu_offload=cpu_offload)
    strategy.parallel_devices = [torch.device("meta")]  # stands for the GPU
    with strategy.tensor_init_context():
        built = torch.nn.Linear(2, 2)
    assert built.weight.device.type == ("cpu" if cpu_offload else "meta")


def test_only_the_transformers_models_stay_on_the_host():
    """Under cpu_offload the strategy moves the LightningModule to the device except its transformers models
    (fully_shard takes those to the device one block at a time): buffers and metrics outside them move."""
    from lightning_longctx.parallel.fsdp import move_all_but_models

    module = torch.nn.Module()
    module.model = tiny_model("llama", layers=1)
    module.head = torch.nn.Linear(2, 2)
    module.register_buffer("count", torch.zeros(()))
    move_all_but_models(module, torch.device("meta"))
    assert {t.device.type for t in [*module.model.parameters(), *module.model.buffers()]} == {"cpu"}
    assert {t.device.type for t in [*module.head.parameters(), module.count]} == {"meta"}


class _OptimizerKind(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.foreach = trainer.optimizers[0].defaults["foreach"]


def _fit_causal_lm(cpu_offload: bool):
    """CausalLM (AdamW, weight decay on matrices) for two steps on one rank: its parameters and optimizer kind."""
    from torch.utils.data import DataLoader

    lightning_env()
    torch.manual_seed(0)
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "tie_word_embeddings": False}  # fmt: skip
    model = CausalLM(model_config=config, lr=1e-2, weight_decay=0.1)
    kind = _OptimizerKind()
    dp = {"data_parallel": "fsdp", "cpu_offload": True} if cpu_offload else {}
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=1, **dp), accelerator="cpu", devices=1,
        max_steps=2, callbacks=[kind], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(TokenDataset(2, SEQ), batch_size=1))
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return state, kind.foreach


def test_causal_lm_steps_host_parameters_with_foreach_adamw(dist_pool):
    """CausalLM's AdamW over host DTensors (cpu_offload) is torch's foreach kernel (one dispatch per op, not one
    per parameter and op), with the same numbers as the default kernel over replicated parameters."""
    ((offload, foreach),) = dist_pool(1).run(_fit_causal_lm, True)
    ((plain, default),) = dist_pool(1).run(_fit_causal_lm, False)
    assert foreach is True and default is None
    err = _worst(offload, plain)
    assert err <= 1e-6, f"foreach AdamW on the host vs the default: {err:.2e}"


# ---- on a GPU ----


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (run by benchmarks/gpu/check.sh)")
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cpu_offload_on_gpu_keeps_state_on_host(precision):
    """One GPU, FSDP2 over a 1-rank mesh with cpu_offload: parameters (pinned), gradients and AdamW state
    on the host, the rotary buffers on the device (fully_shard moves a module's buffers to the mesh's device
    and only the sharded parameters return to the host); gradient clipping runs (its norm is reduced over CPU
    tensors: the strategy adds a gloo backend for them)."""
    module = HFModule(tiny_model("llama"), dataset=TokenDataset(2, SEQ), adam=True)
    probe = _Probe()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=1, cpu_offload=True, **FPDT),
        accelerator="cuda", devices=1, max_steps=2, precision=precision, gradient_clip_val=1.0,
        callbacks=[probe], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    _offloaded(probe.seen, pin_memory=True)
    assert probe.seen["pinned"] == {True}
    assert probe.seen["buffers"] == {"cuda"}
    low = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    assert probe.seen["layer_out"] == {low}
    assert all(torch.isfinite(torch.tensor(module.losses)))
