"""The fit check (``fit_check.py``): the first training step planned against the device's memory before it runs.

Forced on the CPU with a small capacity (``fit_check_device_memory``): a tiny Llama at 65,536 tokens needs
353 MiB per device by the planner (a CPU run: no CUDA context in the reserve), more than the 256 MiB given, and
is refused before its first step, on every rank alike; at 24 tokens it fits and trains, and what the strategy
planned is what ``lightning-longctx plan`` plans for the same config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader

from helpers.hf_models import TINY_LLAMA, HFModule, TokenDataset, tiny_config, tiny_model
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.config import SequenceParallelConfig
from lightning_longctx.lightning.fit_check import Unplannable, check_first_step, enabled, fit_check_capacity
from lightning_longctx.parallel.self_test import probe_shape
from lightning_longctx.planner import format_bytes, parse_bytes, plan_memory
from lightning_longctx.testing import Sabotage, assert_catches, sabotaged

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
CAPACITY = "256MiB"
LONG, SHORT = 65536, 24
FORCED = {"fit_check": True, "fit_check_device_memory": CAPACITY}


def _trainer(strategy, steps):
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _fit(seq, strategy_kwargs, sp=1, steps=1):
    """In a pool rank: fit the tiny Llama (SGD) on ``seq`` tokens; (error or None, steps run, the plan)."""
    lightning_env()
    module = HFModule(tiny_model("llama"), dataset=TokenDataset(dist.get_world_size() // sp * steps, seq))
    strategy = UlyssesFPDTStrategy(sequence_parallel_size=sp, **strategy_kwargs)
    try:
        _trainer(strategy, steps).fit(module)
    except ValueError as err:
        return str(err), len(module.losses), None
    plan = strategy.fit_plan
    return None, len(module.losses), None if plan is None else plan.to_dict()


def _expected(seq, **kwargs):
    """The planner's plan of the tiny Llama's step (HFModule's optimizer: SGD without momentum)."""
    return plan_memory(
        tiny_config("llama"),
        seq_len=seq,
        optimizer="sgd",
        device_memory=CAPACITY,
        device_type="cpu",
        **kwargs,
    )


def test_a_step_that_does_not_fit_is_refused_before_it_runs(dist_pool):
    plan = _expected(LONG, sequence_parallel_size=1)
    assert not plan.fits and plan.device_needed > parse_bytes(CAPACITY)
    msg, steps, _ = dist_pool(1).run(_fit, LONG, FORCED)[0]
    assert msg is not None and steps == 0, "the step must be refused before it runs"
    assert "does not fit the device" in msg, msg
    assert f"needs {format_bytes(plan.device_needed)} per device" in msg, msg
    assert f"fit_check_device_memory='{CAPACITY}' has {format_bytes(parse_bytes(CAPACITY))}" in msg, msg
    assert f"largest terms: activations kept for backward {format_bytes(plan['activations kept for backward'].device)}" in msg  # fmt: skip
    ckpt = _expected(LONG, sequence_parallel_size=1, activation_checkpointing=True)
    assert ckpt.fits, "the test needs a setting that fits"
    assert f"activation_checkpointing=True: needs {format_bytes(ckpt.device_needed)}" in msg, msg
    assert "fpdt_chunk_size=4096: needs" in msg and "fit_check=False skips this check" in msg, msg


def test_all_ranks_refuse_together(dist_pool):
    """Two data-parallel ranks plan alike and raise the same error; a larger sp is among the fixes."""
    results = dist_pool(2).run(_fit, LONG, FORCED)
    assert all(steps == 0 for _, steps, _ in results)
    msgs = {msg for msg, _, _ in results}
    assert len(msgs) == 1 and None not in msgs, msgs
    (msg,) = msgs
    sp2 = _expected(LONG, sequence_parallel_size=2)
    assert sp2.fits, "the test needs a larger sp that fits"
    assert f"sequence_parallel_size=2 (dp 2 -> 1: fewer sequences per step): needs {format_bytes(sp2.device_needed)}" in msg  # fmt: skip
    assert "sp 1 x dp 2" in msg, msg


def _as_info(rank_zero_warn):
    """Sabotage: the strategy's warnings said as info lines (no ``UserWarning``)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    return rank_zero_info


def _fit_causal_lm(seq, steps, strategy_kwargs):
    """In a pool rank: ``CausalLM`` (AdamW, its own activation checkpointing) on the tiny Llama config; the
    steps run, the fit check's plan and the warnings it gave."""
    from lightning_longctx.recipes import CausalLM

    lightning_env()
    module = CausalLM(model_config=dict(TINY_LLAMA), activation_checkpointing=True)
    strategy = UlyssesFPDTStrategy(sequence_parallel_size=1, **strategy_kwargs)
    trainer = _trainer(strategy, steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(TokenDataset(steps, seq), batch_size=1))
    said = [f"{w.category.__name__}: {w.message}" for w in caught if "fit check" in str(w.message)]
    return trainer.global_step, strategy.fit_plan.to_dict(), said


def test_a_step_that_fits_trains_as_planned_by_lightning_longctx_plan(dist_pool, tmp_path):
    """What the strategy plans is what ``lightning-longctx plan`` plans for the same config; given a capacity
    with just under 5 % of it free, the run trains and the strategy warns (a ``UserWarning``)."""
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true",
                    "strategy": {"class_path": "lightning_longctx.UlyssesFPDTStrategy",
                                 "init_args": {"sequence_parallel_size": 1, **FORCED}}},
        "model": {"class_path": "lightning_longctx.recipes.CausalLM",
                  "init_args": {"model_config": dict(TINY_LLAMA), "activation_checkpointing": True}},
        "data": {"init_args": {"seq_len": SHORT, "batch_size": 1}},
    }  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    from lightning_longctx.cli.plan import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--config", str(path), "--json"]) == 0
    cli = json.loads(out.getvalue())
    tight = math.ceil(cli["device_needed"] / 0.95) - 1  # 1 byte less than 5 % free
    forced = {"fit_check": True, "fit_check_device_memory": tight}

    def warned_on_a_tight_capacity(fit=_fit_causal_lm):
        steps, plan, said = dist_pool(1).run(fit, SHORT, 2, forced)[0]
        assert steps == 2 and plan["fits"] and plan["device_memory"] == tight
        warned = len(said) == 1 and said[0].startswith("UserWarning: UlyssesFPDTStrategy fit check")
        assert warned, f"the fit check's warnings: {said}"
        assert "less than 5%: the plan is a model" in said[0], said
        assert f"{format_bytes(tight)}: {format_bytes(tight - cli['device_needed'])} free" in said[0], said
        return plan

    plan = warned_on_a_tight_capacity()
    quiet = Sabotage(
        "the warning said as info", "lightning_longctx.lightning.first_step:rank_zero_warn", _as_info
    )
    assert_catches(
        lambda: warned_on_a_tight_capacity(sabotaged(quiet, _fit_causal_lm)),
        quiet,
        match=r"the fit check's warnings: \[\]",
    )
    assert plan["activation_checkpointing"] and plan["optimizer"] == "adamw"
    for key in (
        "device_total",
        "device_reserve",
        "host_total",
        "components",
        "phases",
        "params",
        "precision",
    ):
        assert plan[key] == cli[key], key


def _check_the_warning_margin() -> None:
    """No Trainer: a capacity given as ``fit_check_device_memory`` with just under 5 % of it free fits with a
    warning that names the margin and the largest terms; exactly 5 % and 10 % free fit without one."""
    parallel = SequenceParallelConfig(sequence_parallel_size=1).resolve(1, 1, "cpu")
    model = tiny_model("llama")
    batch = {"input_ids": torch.zeros(2, SHORT, dtype=torch.long)}
    sgd = [torch.optim.SGD(model.parameters(), lr=0.1)]
    need = _expected(SHORT, sequence_parallel_size=1, micro_batch_size=2).device_needed
    edge = math.ceil(need / 0.95)  # the least capacity with 5 % of it free
    assert 0.0499 < 1 - need / (edge - 1) < 0.05
    cases = {
        "4.99 % free": (edge - 1, True),
        "5 % free": (edge, False),
        "10 % free": (math.ceil(need / 0.9), False),
    }
    for name, (size, warned) in cases.items():
        capacity = fit_check_capacity(True, f"{size}B")
        verdict = check_first_step(model, [model], sgd, parallel, batch, precision="32-true", capacity=capacity,
                                   where="fit_check_device_memory", device_type="cpu")  # fmt: skip
        assert verdict.fits and verdict.plan.device_needed == need, name
        assert verdict.warn == warned, f"{name}: warned {verdict.warn}: {verdict.message}"
        assert ("less than 5%" in verdict.message) == warned, (name, verdict.message)
        assert ("largest terms: " in verdict.message) == warned, (name, verdict.message)


def _no_margin(margin: float) -> float:
    """Sabotage: the fit check's warning margin gone (a step that fits is never warned about)."""
    return 0.0


def test_under_5_percent_free_is_warned_about():
    """The CHANGELOG's "under 5 % free is warned about"; the check fails when the margin is gone."""
    _check_the_warning_margin()
    sabotage = Sabotage("no warning margin", "lightning_longctx.lightning.fit_check:WARN_MARGIN", _no_margin)
    assert_catches(_check_the_warning_margin, sabotage, match="4.99 % free: warned False")


def test_auto_on_cpu_does_nothing(dist_pool):
    msg, steps, plan = dist_pool(1).run(_fit, SHORT, {})[0]
    assert msg is None and steps == 1 and plan is None
    assert (
        not enabled("auto", None, "cpu") and enabled("auto", None, "cuda") and enabled("auto", 1 << 30, "cpu")
    )
    assert not enabled(False, 1 << 30, "cuda")


def test_a_plan_equal_to_the_planners_and_what_is_not_planned():
    """No Trainer: the check's plan is the planner's (SGD, the batch's shape); models it cannot plan are skipped."""
    parallel = SequenceParallelConfig(sequence_parallel_size=1).resolve(1, 1, "cpu")
    model = tiny_model("llama")
    batch = {"input_ids": torch.zeros(2, SHORT, dtype=torch.long)}
    sgd = [torch.optim.SGD(model.parameters(), lr=0.1)]
    kw = dict(precision="32-true", capacity=parse_bytes(CAPACITY), where="here", device_type="cpu")
    verdict = check_first_step(model, [model], sgd, parallel, batch, **kw)
    assert verdict.fits and verdict.plan == _expected(SHORT, sequence_parallel_size=1, micro_batch_size=2)
    with pytest.raises(Unplannable, match="no transformers model"):
        check_first_step(torch.nn.Linear(2, 2), [], [], parallel, batch, **kw)
    momentum = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    with pytest.raises(Unplannable, match="optimizer SGD"):
        check_first_step(model, [model], momentum, parallel, batch, **kw)
    model.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(Unplannable, match="2,048 of 19,616 parameters are frozen"):
        check_first_step(model, [model], sgd, parallel, batch, **kw)
    moe = tiny_model("mixtral")
    with pytest.raises(Unplannable, match="mixture-of-experts"):
        check_first_step(moe, [moe], [], parallel, batch, **kw)


def test_lora_is_planned_with_its_adapters():
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(tiny_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    parallel = SequenceParallelConfig(sequence_parallel_size=1).resolve(1, 1, "cpu")
    adam = [torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad])]
    batch = {"input_ids": torch.zeros(1, SHORT, dtype=torch.long)}
    verdict = check_first_step(peft, [peft.get_base_model()], adam, parallel, batch, precision="32-true",
                               capacity=1 << 40, where="here", device_type="cpu")  # fmt: skip
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert verdict.fits and verdict.plan.lora_rank == 4 and verdict.plan.trainable_params == trainable


def test_the_settings_are_validated():
    params = inspect.signature(UlyssesFPDTStrategy).parameters
    assert params["fit_check"].default == "auto" and params["fit_check_device_memory"].default is None
    assert fit_check_capacity("auto", "h100") == 80 << 30 == fit_check_capacity(True, "80GiB")
    assert (
        fit_check_capacity(False, "H100-80GB") == 80 << 30
        and fit_check_capacity("auto", "141GB") == 141 * 10**9
    )
    with pytest.raises(ValueError, match="fit_check='yes': use 'auto'"):
        UlyssesFPDTStrategy(fit_check="yes")
    with pytest.raises(ValueError, match="fit_check_device_memory='80 bananas' is neither a memory size"):
        UlyssesFPDTStrategy(fit_check_device_memory="80 bananas")
    with pytest.raises(ValueError, match="fit_check=True on a 'cpu' device needs"):
        enabled(True, None, "cpu")


def test_the_shipped_configs_are_planned_as_lightning_longctx_plan_plans_them():
    """Each shipped config's model (built on the meta device), settings and first batch give the fit check the
    plan the CLI prints (those naming the model by ``model_config``; ``pretrained_path`` reads the same config)."""
    from transformers import AutoModelForCausalLM

    from lightning_longctx import enable_activation_checkpointing
    from lightning_longctx.cli.plan import plan_kwargs_from_config
    from lightning_longctx.integrations.hf_config import build_config

    fields = {f.name for f in dataclasses.fields(SequenceParallelConfig)}
    names = sorted(p.name for p in CONFIGS.glob("*.yaml") if "model_config:" in p.read_text())
    assert len(names) >= 4, names
    for name in names:
        config = yaml.safe_load((CONFIGS / name).read_text())
        trainer, model_args = config["trainer"], config["model"]["init_args"]
        data = config["data"]["init_args"]
        hf_config = build_config(dict(model_args["model_config"]), None, model_args.get("config_overrides"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=getattr(torch, model_args.get("dtype") or "float32")
            )
        if model_args.get("activation_checkpointing"):
            enable_activation_checkpointing(model)
        devices, world = trainer["devices"], trainer["devices"] * trainer.get("num_nodes", 1)
        device = "cpu" if trainer.get("accelerator") == "cpu" else "cuda"
        settings = {k: v for k, v in trainer["strategy"]["init_args"].items() if k in fields}
        parallel = SequenceParallelConfig(**settings).resolve(world, devices, device)
        batch = {"input_ids": torch.zeros(data.get("batch_size", 1), data["seq_len"], dtype=torch.long)}
        adam = [torch.optim.AdamW(model.parameters())]
        verdict = check_first_step(model, [model], adam, parallel, batch, precision=str(trainer["precision"]),
                                   capacity=80 << 30, where="here", device_type=device)  # fmt: skip
        model_config, kwargs, _ = plan_kwargs_from_config(config)
        assert verdict.plan == plan_memory(model_config, **kwargs, device_memory=80 << 30), name
        # the self-test before the step is planned too, and needs less than the step it precedes
        halo = 3 if "qwen3_5" in name else 0
        probe = (min(2, batch["input_ids"].shape[0]), probe_shape(parallel, halo, packed=False).length)
        checked = check_first_step(model, [model], adam, parallel, batch, precision=str(trainer["precision"]),
                                   capacity=80 << 30, where="here", device_type=device, probe=probe)  # fmt: skip
        assert "the self-test before it needs" in checked.message
        assert 0 < checked.probe_need < checked.plan.device_needed, (name, checked.message)


def test_a_ring_layout_is_planned_not_refused():
    """Ulysses x ring (sp 4 as ring 2 x Ulysses 2): the check plans it with the planner's ring model (the plan
    ``plan_memory(..., ring_size=2)`` gives), instead of skipping it."""
    parallel = SequenceParallelConfig(sequence_parallel_size=4, ring_size=2).resolve(4, 4, "cpu")
    model = tiny_model("llama")
    batch = {"input_ids": torch.zeros(1, 64, dtype=torch.long)}
    sgd = [torch.optim.SGD(model.parameters(), lr=0.1)]
    verdict = check_first_step(model, [model], sgd, parallel, batch, precision="32-true",
                               capacity=parse_bytes(CAPACITY), where="here", device_type="cpu")  # fmt: skip
    assert verdict.fits and verdict.plan.ring_size == 2
    assert verdict.plan == _expected(64, sequence_parallel_size=4, ring_size=2)
    assert verdict.plan["ring buffers"].largest > 0 and "sp 4 (ring 2 x Ulysses 2)" in verdict.plan.table()


def test_a_ring_run_is_checked_and_trains(dist_pool):
    """The strategy's own ring run (sp 2 = ring 2, forced check): planned, fits, trains; its plan has the ring."""
    for msg, steps, plan in dist_pool(2).run(_fit, SHORT, {**FORCED, "ring_size": 2}, 2):
        assert msg is None and steps == 1 and plan is not None, msg
        assert plan["ring_size"] == 2 and plan["fits"]
        assert plan == _expected(SHORT, sequence_parallel_size=2, ring_size=2).to_dict()


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("llama", {"fpdt_chunk_size": 8, "offload": False}),  # FPDT x ring
        ("llama", {"fpdt_chunk_size": 8, "offload": True}),
        ("qwen3_5", {}),  # a hybrid (gated DeltaNet + attention) under Ulysses x ring
        ("qwen3_5", {"fpdt_chunk_size": 8, "offload": False}),  # and under FPDT x ring
    ],
)
def test_fpdt_and_hybrid_rings_are_planned_not_skipped(arch, settings):
    """FPDT x ring and hybrids under a ring (sp 4 as ring 2 x Ulysses 2): the check plans them with the planner's
    model (the plan ``plan_memory`` gives for the same settings) instead of skipping them."""
    parallel = SequenceParallelConfig(sequence_parallel_size=4, ring_size=2, **settings).resolve(4, 4, "cpu")
    model = tiny_model(arch)
    batch = {"input_ids": torch.zeros(1, 64, dtype=torch.long)}
    sgd = [torch.optim.SGD(model.parameters(), lr=0.1)]
    verdict = check_first_step(model, [model], sgd, parallel, batch, precision="32-true",
                               capacity=1 << 40, where="here", device_type="cpu")  # fmt: skip
    mode = {"mode": "fpdt"} if settings else {}
    expected = plan_memory(tiny_config(arch), seq_len=64, optimizer="sgd", device_memory=1 << 40, device_type="cpu",
                           sequence_parallel_size=4, ring_size=2, **mode, **settings)  # fmt: skip
    assert verdict.fits and verdict.plan == expected and verdict.plan.ring_size == 2
    assert verdict.plan["ring buffers"].largest > 0
    assert ("FPDT x ring" if settings else "Ulysses x ring") in verdict.plan.table()
