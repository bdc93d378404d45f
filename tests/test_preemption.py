"""Preemption: a signal only sets a flag; every rank saves at the next optimizer-step boundary and exits;
``--ckpt_path auto`` (the resolver) resumes from the newest committed checkpoint.

Fast tier: the handler touches nothing but its flag (every collective raises while it runs), Lightning's
SIGTERM notifier is not chained, the boundary logic (no collective inside an accumulation window; save, requeue,
exit after a signal), the strategy's installation, the resolver and the CLI's ``auto``.

Slow tier: 4 gloo ranks under FSDP + TP 2 + SP 2 + state offload + FPDT host offload + activation offload,
gradient accumulation 2 and a validation after every optimizer step. ONE rank sends itself a signal from a
decoder layer's forward hook: mid-step, inside an accumulation window, during validation, and SIGTERM. Every
rank saves at the same boundary and stops; the run resumed from ``latest_checkpoint(root)`` ends with every
parameter equal to the uninterrupted run's. The process exit and the SLURM requeue under a faked srun are in
test_faults.py.
"""

from __future__ import annotations

import os
import signal
import types
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

from helpers.hf_models import HFModule, TokenDataset, tiny_model
from helpers.lightning import lightning_env
from lightning_longctx import UlyssesFPDTStrategy
from lightning_longctx.lightning import preemption
from lightning_longctx.lightning.callbacks import Preempted, Preemption
from lightning_longctx.lightning.checkpoint import (
    COMMIT_FILE,
    commit,
    commit_info,
    latest_checkpoint,
    partial_path,
)

SEQ = 24
STEPS = 4  # optimizer steps
ACCUMULATE = 2
#: the issue's settings: FSDP2 + TP + SP at world 4 (dp 1), state offload, FPDT host offload, activation offload
SETTINGS = {
    "data_parallel": "fsdp",
    "sequence_parallel_size": 2,
    "tensor_parallel_size": 2,
    "cpu_offload": True,
    "fpdt_chunk_size": 4,
    "offload": True,
    "activation_offload": True,
}
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "barrier",
    "all_gather",
    "all_gather_object",
    "broadcast_object_list",
)


# ---- fast tier: the handler ----


@pytest.fixture
def restore_signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _forbid_collectives(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran inside a signal handler")

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, refuse)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # Lightning's notifier would broadcast now


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


def test_handler_only_sets_the_flag_and_drops_lightnings_notifier(monkeypatch, restore_signals):
    """Under Lightning's own handlers (its SIGTERM notifier broadcasts inside the handler): after
    on_train_start both signals only record the signal; a user's own earlier SIGTERM handler still runs;
    every collective raises meanwhile, and Lightning never sees a SIGTERM."""
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))  # the user's own
    trainer = _trainer()
    trainer._signal_connector.register_signal_handlers()
    assert isinstance(signal.getsignal(signal.SIGTERM), _HandlersCompose)
    callback = Preemption()
    callback.on_train_start(trainer, None)
    assert signal.getsignal(signal.SIGUSR1) == callback.handle
    assert signal.getsignal(signal.SIGTERM) == callback.handle
    _forbid_collectives(monkeypatch)
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.undo()
    assert callback.received == {signal.SIGUSR1, signal.SIGTERM}
    assert seen == [signal.SIGTERM]
    assert not trainer.received_sigterm  # Lightning's notifier (and its broadcast) did not run
    callback.on_train_end(trainer, None)  # gives the handlers back to Lightning, which restores its originals
    assert isinstance(signal.getsignal(signal.SIGTERM), _HandlersCompose)
    trainer._signal_connector.teardown()
    assert signal.getsignal(signal.SIGTERM) is not callback.handle


def test_lightning_handlers_are_never_chained():
    connector = _SignalConnector(_trainer())
    user = lambda signum, frame: None  # noqa: E731
    compose = _HandlersCompose([connector._sigterm_notifier_fn, connector._slurm_sigusr_handler_fn, user])
    assert preemption._chainable(compose) == [user]
    assert preemption._chainable(signal.SIG_DFL) == []
    assert preemption._chainable(connector._sigterm_notifier_fn) == []


def test_outside_the_main_thread_it_warns_and_installs_nothing(restore_signals):
    import threading
    import warnings

    before = signal.getsignal(signal.SIGUSR1)
    callback, caught = Preemption(), []

    def start() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            callback.on_train_start(types.SimpleNamespace(global_step=0), None)
        caught.extend(str(w.message) for w in seen)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(timeout=30)
    assert any("cannot install signal handlers" in m and "main thread" in m for m in caught), caught
    assert signal.getsignal(signal.SIGUSR1) == before


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"signals: 'SIGNOPE' is not a signal name .* e\.g\. 'SIGUSR1'"):
        Preemption(signals=["SIGNOPE"])
    with pytest.raises(TypeError, match=r"signals='SIGUSR1': pass a list"):
        Preemption(signals="SIGUSR1")
    with pytest.raises(ValueError, match=r"exit_code=300: use a process exit status, 0\.\.255"):
        Preemption(exit_code=300)
    assert Preemption(signals=["usr1", 15]).signals == (signal.SIGUSR1, signal.SIGTERM)


# ---- fast tier: the step boundary ----


class _FakeStrategy:
    root_device = torch.device("cpu")

    def __init__(self, environment) -> None:
        self.cluster_environment = environment


class _FakeTrainer:
    """What the callback reads of a trainer; records the saves."""

    def __init__(self, root: Path, environment=None) -> None:
        self.global_step = 0
        self.is_global_zero = True
        self.default_root_dir = str(root)
        self.checkpoint_callbacks: list = []
        self.callbacks: list = []
        self.strategy = _FakeStrategy(environment or LightningEnvironment())
        self.saved: list[Path] = []

    def save_checkpoint(self, path) -> None:
        self.saved.append(Path(path))


def _step(callback: Preemption, trainer: _FakeTrainer, advance: bool) -> None:
    trainer.global_step += int(advance)
    callback.on_train_batch_end(trainer, None, None, None, 0)


def test_reduces_once_per_optimizer_step_never_inside_an_accumulation_window(monkeypatch, tmp_path):
    reductions = []

    def count(x, group=None, op="sum"):
        reductions.append((x.tolist(), op))
        return x.clone()

    monkeypatch.setattr(preemption, "all_reduce_no_grad", count)
    trainer = _FakeTrainer(tmp_path)
    callback = Preemption(signals=["SIGUSR1", "SIGTERM"])
    callback._last_step = trainer.global_step  # what on_train_start sets
    _step(callback, trainer, advance=False)  # micro-batch 0 of a window: no collective
    assert reductions == []
    _step(callback, trainer, advance=True)  # the window's last micro-batch stepped: one tiny all-reduce
    assert reductions == [([0, 0], "max")]
    callback.handle(signal.SIGTERM, None)  # mid-window: only at the boundary
    _step(callback, trainer, advance=False)
    assert len(reductions) == 1 and trainer.saved == []
    with pytest.raises(Preempted) as info:
        _step(callback, trainer, advance=True)
    assert reductions[-1] == ([0, 1], "max")
    expected = tmp_path / "checkpoints" / "step-00000002.ckpt"
    assert trainer.saved == [expected]
    assert (info.value.code, info.value.step, info.value.path) == (0, 2, expected)
    assert info.value.signal == signal.SIGTERM and isinstance(info.value, SystemExit)


def test_a_signal_on_another_rank_stops_this_one(monkeypatch, tmp_path):
    """This rank received nothing; the reduction says SIGUSR1 reached some rank: it saves and stops too."""
    monkeypatch.setattr(preemption, "all_reduce_no_grad", lambda x, group=None, op="sum": torch.ones_like(x))
    trainer = _FakeTrainer(tmp_path)
    trainer.checkpoint_callbacks = [ModelCheckpoint(dirpath=tmp_path / "mine")]
    callback = Preemption(exit_code=143)
    with pytest.raises(Preempted) as info:
        _step(callback, trainer, advance=True)
    assert trainer.saved == [tmp_path / "mine" / "step-00000001.ckpt"]  # the ModelCheckpoint's folder
    assert info.value.code == 143


def _slurm_env(monkeypatch, tmp_path: Path, with_scontrol: bool) -> Path:
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    if with_scontrol:
        scontrol = bin_dir / "scontrol"
        scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
        scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # only this folder: no real scontrol either
    return log


@pytest.mark.parametrize(
    ("sent", "with_scontrol", "requeued"),
    [(signal.SIGUSR1, True, True), (signal.SIGTERM, True, False), (signal.SIGUSR1, False, False)],
    ids=["usr1_requeues", "sigterm_does_not", "no_scontrol_warns"],
)
def test_slurm_requeue_after_the_save(monkeypatch, tmp_path, sent, with_scontrol, requeued):
    monkeypatch.setattr(preemption, "all_reduce_no_grad", lambda x, group=None, op="sum": x.clone())
    log = _slurm_env(monkeypatch, tmp_path, with_scontrol)
    trainer = _FakeTrainer(tmp_path, SLURMEnvironment(auto_requeue=False))
    callback = Preemption()
    callback.handle(sent, None)
    with pytest.warns(UserWarning, match="could not run") if not with_scontrol else _nothing():
        with pytest.raises(Preempted):
            _step(callback, trainer, advance=True)
    assert trainer.saved, "the checkpoint comes first"
    assert (log.read_text().split() if log.exists() else []) == (["requeue", "4242"] if requeued else [])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_array_job_id(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert preemption.slurm_job_id() == "5_3"
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    assert preemption.slurm_job_id() == "7"
    monkeypatch.setenv("SLURM_JOB_ID", "7; rm -rf /")
    assert preemption.slurm_job_id() is None


def test_on_exception_checkpoint_does_not_save_the_same_step_twice(tmp_path):
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path)
    callback = Preemption()
    trainer = _FakeTrainer(tmp_path)
    trainer.callbacks = [callback, on_exception]
    stop = Preempted(0, signal=signal.SIGUSR1, step=3, path=tmp_path / "step-00000003.ckpt")
    callback.on_exception(trainer, None, stop)
    on_exception.on_exception(trainer, None, stop)  # skipped once
    assert trainer.saved == []
    on_exception.on_exception(trainer, None, RuntimeError("a real failure"))  # saves again
    assert trainer.saved == [Path(on_exception.ckpt_path)]


def test_preempted_pickles():
    import pickle

    stop = pickle.loads(pickle.dumps(Preempted(3, signal=signal.SIGTERM, step=7, path=Path("x"))))
    assert (stop.code, stop.signal, stop.step, stop.path) == (3, signal.SIGTERM, 7, Path("x"))
    assert "SIGTERM after optimizer step 7" in str(stop)


# ---- fast tier: installation by the strategy ----


def test_strategy_installs_the_callback_and_turns_off_lightnings_requeue(monkeypatch):
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"):  # one task of a faked srun job
        monkeypatch.setenv(key, "0")
    for key in ("SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.setenv(key, "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "longctx")
    environment = SLURMEnvironment(auto_requeue=True)
    checkpoint = ModelCheckpoint()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(sequence_parallel_size=1),
        accelerator="cpu",
        devices=1,
        plugins=[environment],
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
    )
    assert trainer.strategy.cluster_environment is environment
    preemption.install(trainer)  # what UlyssesFPDTStrategy.setup calls
    preemption.install(trainer)  # once only
    assert environment.auto_requeue is False
    ours = [c for c in trainer.callbacks if isinstance(c, Preemption)]
    assert len(ours) == 1
    assert trainer.callbacks.index(ours[0]) < trainer.callbacks.index(checkpoint)
    # a user's own Preemption is kept as it is
    mine = Preemption(signals=["SIGTERM"])
    trainer = _trainer(callbacks=[mine])
    preemption.install(trainer)
    assert [c for c in trainer.callbacks if isinstance(c, Preemption)] == [mine]


# ---- fast tier: the resolver and --ckpt_path auto ----


def _committed(path: Path, step: int) -> Path:
    partial = partial_path(path)
    partial.mkdir(parents=True)
    (partial / "meta.pt").write_bytes(b"")
    commit(partial, path, {"global_step": step})
    return path


def test_resolver_never_picks_a_stray_or_partial_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert latest_checkpoint(run) is None
    good = _committed(run / "checkpoints" / "step-00000003.ckpt", 3)
    (run / "hpc_ckpt_5.ckpt.partial").write_bytes(b"half")  # Lightning's scan reads this as version 5
    (run / "hpc_ckpt_7.ckpt").write_bytes(b"never committed")
    partial_path(run / "checkpoints" / "step-00000009.ckpt").mkdir()  # a save killed midway
    (partial_path(run / "checkpoints" / "step-00000009.ckpt") / COMMIT_FILE).write_text('{"global_step": 9}')
    (run / "checkpoints" / "step-00000008.ckpt").mkdir()  # no marker
    assert latest_checkpoint(run) == good
    assert commit_info(good)["global_step"] == 3


def test_ckpt_path_auto_resolves_to_the_newest_committed_or_fresh(tmp_path):
    from jsonargparse import Namespace

    from lightning_longctx.cli import LongCtxCLI, auto_checkpoint

    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    trainer = _trainer(default_root_dir=str(root), callbacks=[ModelCheckpoint(dirpath=elsewhere)])
    cli = types.SimpleNamespace(trainer=trainer, config_init={"fit": Namespace(ckpt_path="auto")})
    LongCtxCLI._resolve_auto_checkpoint(cli, "fit")
    assert cli.config_init["fit"]["ckpt_path"] is None  # nothing yet: a fresh start
    _committed(root / "checkpoints" / "step-00000002.ckpt", 2)
    newest = _committed(elsewhere / "step-00000004.ckpt", 4)
    assert auto_checkpoint(trainer) == newest
    cli.config_init["fit"]["ckpt_path"] = "auto"
    LongCtxCLI._resolve_auto_checkpoint(cli, "fit")
    assert cli.config_init["fit"]["ckpt_path"] == str(newest)
    cli.config_init["fit"]["ckpt_path"] = "given.ckpt"  # anything else is left alone
    LongCtxCLI._resolve_auto_checkpoint(cli, "fit")
    assert cli.config_init["fit"]["ckpt_path"] == "given.ckpt"


# ---- slow tier: 4 gloo ranks, the signal sent to one rank ----


class _Module(HFModule):
    """AdamW, the training data resumable mid-epoch, and one validation batch."""

    def __init__(self) -> None:
        super().__init__(tiny_model("llama"), dataset=TokenDataset(STEPS * ACCUMULATE, SEQ), adam=True)

    def train_dataloader(self):
        from lightning_longctx.data import ResumableDataLoader

        return ResumableDataLoader(self.dataset, batch_size=1, shuffle=False)

    def validation_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def val_dataloader(self):
        return torch.utils.data.DataLoader(TokenDataset(2, SEQ, seed=1), batch_size=1)


class _SendSignal(L.Callback):
    """On ``rank``, a forward hook of the first decoder layer sends ``signal`` to its own process once: in
    micro-batch ``micro`` of the window that makes optimizer step ``step`` + 1, or (``micro=None``) in the
    validation that runs after optimizer step ``step``."""

    def __init__(self, sig: signal.Signals, rank: int, step: int, micro: int | None) -> None:
        self.sig, self.rank, self.step, self.micro = sig, rank, step, micro
        self.sent_at: tuple | None = None
        self._batch_idx = -1

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        layer = next(m for m in pl_module.modules() if type(m).__name__.endswith("DecoderLayer"))

        def hook(module, args, out) -> None:
            if self.sent_at is not None or trainer.global_step != self.step:
                return
            if self.micro is None and trainer.validating:
                where = "validation"
            elif self.micro is not None and trainer.training and self._batch_idx % ACCUMULATE == self.micro:
                where = f"micro-batch {self.micro}"
            else:
                return
            self.sent_at = (trainer.global_step, where)
            os.kill(os.getpid(), self.sig)

        layer.register_forward_hook(hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch_idx = batch_idx


def _fit(root: str, *, send: tuple | None = None, ckpt_path: str | None = None, **settings) -> dict:
    """One fit with the issue's settings; what this rank saw: how it ended, its state (rank 0: the full
    parameters; FSDP gathers them there), the signals its own handler received, the handlers after."""
    lightning_env()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    sender = _SendSignal(*send) if send is not None else None
    module = _Module()
    trainer = L.Trainer(
        strategy=UlyssesFPDTStrategy(**SETTINGS, **settings),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        val_check_interval=ACCUMULATE,  # a validation after every optimizer step
        limit_val_batches=1,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=[sender] if sender else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ours = None
    stopped = None
    try:
        trainer.fit(module, ckpt_path=ckpt_path)
    except Preempted as stop:
        stopped = (stop.signal, stop.step, str(stop.path))
    ours = next(c for c in trainer.callbacks if isinstance(c, Preemption))
    state = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}
    return {
        "stopped": stopped,
        "global_step": trainer.global_step,
        "received": sorted(ours.received),
        "sent_at": None if sender is None else sender.sent_at,
        "state": state if trainer.is_global_zero else None,
        "handlers_restored": all(signal.getsignal(sig) == h for sig, h in before.items()),
    }


@pytest.fixture(scope="module")
def uninterrupted(dist_pool, tmp_path_factory):
    results = dist_pool(4).run(_fit, str(tmp_path_factory.mktemp("full")), timeout=600)
    assert [r["stopped"] for r in results] == [None] * 4
    assert [r["global_step"] for r in results] == [STEPS] * 4
    state, init = results[0]["state"], tiny_model("llama").state_dict()
    assert all(not torch.equal(state[k], init[k]) for k in init if k.endswith("proj.weight")), "not trained"
    return state


def _assert_equal(resumed: dict, full: dict) -> float:
    assert resumed.keys() == full.keys()
    worst = max((resumed[k] - full[k]).abs().max().item() for k in full)
    differ = [k for k in full if not torch.equal(resumed[k], full[k])]
    assert not differ, f"parameters differ after resume (max abs diff {worst:.3g}): {differ}"
    return worst


CASES = {
    # name: (signal, sending rank, optimizer step during which it is sent, micro-batch or None = validation,
    #        other strategy settings)
    "usr1_mid_step": (signal.SIGUSR1, 1, 1, 1, {}),
    "usr1_mid_accumulation_window": (signal.SIGUSR1, 2, 1, 0, {}),
    "usr1_during_validation": (signal.SIGUSR1, 3, 1, None, {}),
    "sigterm_mid_step": (signal.SIGTERM, 0, 2, 1, {}),
    # the save is written in the background; the exit (the strategy's teardown) waits for it and commits it
    "usr1_mid_step_async_save": (signal.SIGUSR1, 1, 1, 1, {"async_save": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_signal_to_one_rank_saves_on_every_rank_and_resumes_exactly(dist_pool, uninterrupted, tmp_path, case):
    sig, rank, step, micro, settings = CASES[case]
    root = str(tmp_path)
    pool = dist_pool(4)
    first = pool.run(_fit, root, send=(sig, rank, step, micro), timeout=600, **settings)
    where = "validation" if micro is None else f"micro-batch {micro}"
    assert first[rank]["sent_at"] == (step, where), first[rank]["sent_at"]
    # only that rank's handler saw it; the reduction stopped every rank at the next optimizer step, step + 1
    # (a signal during the validation after step `step` is seen at the end of step + 1's window)
    assert [r["received"] for r in first] == [[sig] if r is first[rank] else [] for r in first]
    expected = step + 1
    path = str(Path(root) / "checkpoints" / f"step-{expected:08d}.ckpt")
    stops = [r["stopped"] for r in first]
    assert stops == [(sig, expected, path)] * 4, f"ranks stopped differently: {stops}"
    assert [r["global_step"] for r in first] == [expected] * 4
    assert all(r["handlers_restored"] for r in first), "the signal handlers were not given back"
    assert commit_info(path)["global_step"] == expected
    assert str(latest_checkpoint(root)) == path
    resumed = pool.run(_fit, root, ckpt_path=str(latest_checkpoint(root)), timeout=600, **settings)
    assert [r["stopped"] for r in resumed] == [None] * 4
    assert [r["global_step"] for r in resumed] == [STEPS] * 4
    _assert_equal(resumed[0]["state"], uninterrupted)


@pytest.mark.slow  # two real two-process fits of the demo config from the console script
def test_cli_ckpt_path_auto_starts_fresh_then_resumes(tmp_path):
    """`lightning-longctx fit --ckpt_path auto`: the first run finds no checkpoint and starts fresh; the
    second (the same command, as a requeued job runs it) resumes from the newest committed checkpoint."""
    import subprocess
    import sys

    import yaml

    root = Path(__file__).resolve().parents[1]
    extra = tmp_path / "extra.yaml"
    extra.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "default_root_dir": str(tmp_path / "run"),
                    "logger": False,
                    "enable_progress_bar": False,
                    "num_sanity_val_steps": 0,
                    "limit_val_batches": 0,
                    "callbacks": [
                        {  # every save under the strategy is committed, whoever asks for it
                            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                            "init_args": {"every_n_train_steps": 2, "save_top_k": -1},
                        }
                    ],
                }
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)

    def fit(steps: int) -> str:
        cmd = [sys.executable, "-m", "lightning_longctx", "fit", "--config", "examples/configs/demo_cpu.yaml"]
        # fsdp: a sharded directory per checkpoint (the format a large run writes)
        cmd += ["--config", str(extra), "--trainer.strategy.init_args.data_parallel=fsdp"]
        cmd += [f"--trainer.max_steps={steps}", "--ckpt_path", "auto"]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{output[-6000:]}"
        return output

    assert "--ckpt_path auto: no committed checkpoint" in fit(2)
    first = latest_checkpoint(tmp_path / "run")
    assert first is not None and commit_info(first)["global_step"] == 2
    assert f"--ckpt_path auto: resuming from {first}" in fit(4)
    assert commit_info(latest_checkpoint(tmp_path / "run"))["global_step"] == 4
