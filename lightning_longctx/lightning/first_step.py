"""What the strategy checks before the first training step runs: the fit check (``fit_check.py``: the step's
planned peak against the device's memory) and the self-test (``parallel/self_test.py``: the model as parallelized
against itself with sequence parallelism off). A mixin of :class:`~lightning_longctx.UlyssesFPDTStrategy`: it reads
the strategy's plan, precision, devices and optimizers."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_longctx.integrations.hybrid import packed_documents_refusal
from lightning_longctx.lightning.fit_check import (
    Unplannable,
    check_first_step,
    device_capacity,
    enabled,
    fit_check_capacity,
)
from lightning_longctx.parallel.comm import all_reduce_no_grad
from lightning_longctx.parallel.parallelize import Parallelized
from lightning_longctx.planner import MemoryPlan


class FirstStepChecks:
    """The fit check and the self-test, run once per fit on its first training batch (on every rank)."""

    def _init_first_step_checks(
        self, fit_check: Any, fit_check_device_memory: int | str | None, self_test: Any
    ) -> None:
        if self_test not in (True, False, "auto"):
            raise ValueError(f"self_test={self_test!r} must be 'auto', True or False")
        self._fit_check = fit_check
        self._fit_check_memory = fit_check_capacity(fit_check, fit_check_device_memory)  # None: the device's
        self._fit_check_device = fit_check_device_memory  # as given, for the messages
        self._fit_check_pending = fit_check is not False
        self._fit_plan: MemoryPlan | None = None
        self._self_test = self_test
        self._self_test_pending = self_test is not False
        #: the self-test's reports (``self_test.SelfTestReport``), one per model, once it ran
        self.self_test_reports: list[Any] = []

    def _announce_self_test(self) -> None:
        """Setup: say when the self-test will not run, or refuse ``self_test=True`` where it cannot."""
        if not self._fitting or self._self_test is False:
            if self._fitting:
                rank_zero_info("UlyssesFPDTStrategy self-test off (self_test=False): the run is not checked")
            return
        if not self._contexts and self.sp_size > 1:
            why = (
                "the LightningModule holds no transformers model; a plain module calls our attention itself and "
                "has no sequence-parallel-off twin to compare with"
            )
            if self._self_test is True:
                raise ValueError(f"self_test=True cannot run: {why}. Use self_test='auto' or False")
            rank_zero_info(f"UlyssesFPDTStrategy self-test skipped: {why}")

    # ---- the self-test (self_test.py) ----
    @property
    def _float32_before_sharding(self) -> bool:
        """FSDP2 under a ``*-mixed`` precision computes in its low ``param_dtype``: no float32 run is possible
        after it shards, so the self-test's float32 check runs just before, on the model every device holds
        whole at that point (with ``cpu_offload`` the host holds it: not checked in float32)."""
        return (
            self._fitting
            and self._self_test is not False
            and self.plan.data_parallel.shards
            and self._precision.endswith("-mixed")
            and not self.sp_config.cpu_offload
        )

    def _float32_self_test(self, done: Parallelized) -> None:
        """``parallelize``'s hook before FSDP2: the float32 check on a probe of synthetic tokens (no batch is at
        hand yet), the same probe rules; two packed documents unless a mixer refuses them."""
        from lightning_longctx.parallel.self_test import synthetic_batch

        if not self._float32_before_sharding or not done.contexts:
            return
        try:
            self._self_test_run(
                done,
                synthetic_batch(done.models[0], self.root_device),
                "in float32, before FSDP2 shards the model, ",
                precision="32-true",
                autocast=lambda: torch.autocast(self.root_device.type, enabled=False),
                packed=all(packed_documents_refusal(ctx) is None for ctx in done.contexts),
            )
        except BaseException:
            done.undo()  # raised inside parallelize: the strategy holds no handle yet to undo it at teardown
            raise

    def _run_self_test(self, batch: Mapping[str, Any]) -> None:
        """The first training batch, after its checks, before its forward: every patched model against itself
        with sequence parallelism off (every rank; the verdict agreed inside)."""
        self._self_test_pending = False
        if not self._contexts:
            return  # said at setup
        self._self_test_run(
            self.plan.parallelized,
            batch,
            "",
            precision=self._precision,
            autocast=self.precision_plugin.train_step_context,
            # FSDP2 computes in the low param_dtype of a "-mixed" precision: its float32 check ran before it sharded
            fp32_layout=self._precision.endswith("-mixed") and not self.plan.data_parallel.shards,
        )

    def _self_test_run(
        self, done: Parallelized, batch: Mapping[str, Any], when: str, **settings: Any
    ) -> None:
        """``self_test.run_self_test`` of ``done``'s models on ``batch`` with this strategy's layout; its reports
        kept in :attr:`self_test_reports`, one info line on a match (it raises on a mismatch)."""
        from lightning_longctx.parallel.self_test import run_self_test

        start = time.perf_counter()
        reports = run_self_test(
            list(done.models),
            list(done.contexts),
            batch,
            config=self.config,
            group=self.sp_group,
            device=self.root_device,
            **settings,
        )
        self.self_test_reports += reports
        rank_zero_info(
            f"UlyssesFPDTStrategy self-test {when}passed in {time.perf_counter() - start:.2f} s: "
            + "; ".join(r.summary() for r in reports)
        )

    def _self_test_probe(self, batch: Any) -> tuple[int, int] | None:
        """``(rows, tokens)`` of the self-test's probe for ``batch`` (``None``: no self-test will run)."""
        if not self._self_test_pending or not self._contexts:
            return None
        from lightning_longctx.parallel.self_test import probe_shape

        rows = min(2, int(batch["input_ids"].shape[0]))
        halo = max(ctx.mixer_halo for ctx in self._contexts)
        return rows, probe_shape(self.config, halo, packed=False).length

    # ---- the fit check (fit_check.py) ----
    @property
    def fit_plan(self) -> MemoryPlan | None:
        """The memory plan of the first training step the fit check made (``plan.table()`` prints it): ``None``
        before it, or when the check was off or could not plan the model."""
        return self._fit_plan

    def _check_first_step_fits(self, batch: Any) -> None:
        """The first training batch, before its forward: plan its step (no collective; alike on every rank)
        against the device's memory, the smallest of all ranks', and refuse it on every rank where it does not
        fit (the verdicts agreed by one all-reduce); a model the planner cannot plan is not checked."""
        self._fit_check_pending = False
        capacity, device = self._fit_check_memory, self.root_device
        if not enabled(self._fit_check, capacity, device.type):
            return
        where = f"fit_check_device_memory={self._fit_check_device!r}"
        if capacity is None:
            total, where = device_capacity(device)
            capacity = int(all_reduce_no_grad(torch.tensor([total], device=device), op="min")[0])
        verdict = None
        try:
            verdict = check_first_step(
                self.lightning_module,
                list(self.plan.parallelized.models),
                self._raw_optimizers(),
                self.config,
                batch,
                precision=self._precision,
                capacity=capacity,
                where=where,
                device_type=device.type,
                probe=self._self_test_probe(batch),
            )
        except Unplannable as why:
            rank_zero_info(
                f"UlyssesFPDTStrategy fit check skipped, the memory planner cannot plan this step: {why}"
            )
        except Exception as err:  # never fail a run because of the check itself
            rank_zero_info(f"UlyssesFPDTStrategy fit check skipped: {type(err).__name__}: {err}")
        refused = verdict is not None and not verdict.fits
        if all_reduce_no_grad(torch.tensor([float(refused)], device=device), op="max")[0]:
            raise ValueError(
                verdict.message if refused else "the fit check refused the first step on another rank"
            )
        if verdict is not None:
            self._fit_plan = verdict.plan
            (rank_zero_warn if verdict.warn else rank_zero_info)(verdict.message)
