"""Surviving faults: a rank SIGKILLed under torchrun, and SLURM's SIGUSR1 (or a SIGTERM) sent to ONE rank
mid-step under a faked srun: every rank saves at the next optimizer step, rank 0 requeues, every process exits.

Each run trains a tiny Llama with sp=2, FPDT chunking and host offload (and, in one test, activation
offload too) and commits a checkpoint every step; the restart resumes from the newest committed checkpoint
(``latest_checkpoint``, what ``--ckpt_path auto`` does). After it the loss of every step must equal the
uninterrupted run's, and so must every final parameter (same batches, same ops in the same order).
The 4-rank FSDP + TP version of the preemption protocol is in test_preemption.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "train_tiny.py"
STEPS = 6


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "losses_rank0.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a re-run step keeps its last (resumed) value


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCHELASTIC", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _tail(output: str, lines: int = 80) -> str:
    return "\n".join(output.splitlines()[-lines:])


def _torchrun(out: Path, *args: str) -> tuple[int, str]:
    """Run train_tiny.py on 2 ranks under torchrun; its return code and the tail of its stdout + stderr."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(SCRIPT),
        "--out",
        str(out),
        "--max-steps",
        str(STEPS),
        *args,
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    return proc.returncode, _tail(f"{proc.stdout}\n--- stderr ---\n{proc.stderr}")


def _run_ok(out: Path, *args: str) -> None:
    code, output = _torchrun(out, *args)
    assert code == 0, f"train_tiny.py {' '.join(args)} exited {code}:\n{output}"


def _run_killed(out: Path, *args: str) -> None:
    code, output = _torchrun(out, *args)  # torchrun tears the job down when rank 1 dies
    assert code != 0, f"train_tiny.py {' '.join(args)} should have died, exited 0:\n{output}"
    assert (out / "losses_rank0.jsonl").exists(), f"no step ran before the kill:\n{output}"
    assert max(_losses(out)) == 2, (_losses(out), output)  # steps 0..2 done, step 3 never finished


def _params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final_params.pt", map_location="cpu", weights_only=True)


def _assert_same_losses(resumed: dict[int, float], full: dict[int, float]) -> None:
    assert sorted(resumed) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(resumed[step] - full[step]) < 1e-6, (step, resumed[step], full[step])


def _assert_same_params(resumed: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    """Every parameter bit-identical: the resumed run does the same ops in the same order."""
    assert sorted(resumed) == sorted(full)
    differ = {
        name: (resumed[name] - full[name]).abs().max().item()
        for name in full
        if not torch.equal(resumed[name], full[name])
    }
    assert not differ, f"parameters differ after resume (max abs diff): {differ}"


def _assert_trained(params: dict[str, torch.Tensor]) -> None:
    """The final parameters moved away from initialization, so comparing them proves something."""
    from helpers.hf_models import tiny_model

    init = tiny_model("llama").state_dict()
    assert sorted(params) == sorted(init)
    moved = [name for name in init if not torch.equal(params[name], init[name])]
    assert any(name.endswith("weight") for name in moved), "training left every weight at its init"


@dataclasses.dataclass(frozen=True)
class Run:
    losses: dict[int, float]
    params: dict[str, torch.Tensor]


def _uninterrupted(out: Path, *args: str) -> Run:
    _run_ok(out, *args)
    run = Run(_losses(out), _params(out))
    assert sorted(run.losses) == list(range(STEPS))
    _assert_trained(run.params)
    return run


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Run:
    return _uninterrupted(tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def uninterrupted_activation_offload(tmp_path_factory) -> Run:
    return _uninterrupted(tmp_path_factory.mktemp("full_act_offload"), "--activation-offload")


@pytest.mark.slow
def test_sigkill_one_rank_then_resume_matches(uninterrupted, tmp_path):
    _run_killed(tmp_path, "--kill-at", "3")
    _run_ok(tmp_path, "--resume")
    _assert_same_losses(_losses(tmp_path), uninterrupted.losses)
    _assert_same_params(_params(tmp_path), uninterrupted.params)


@pytest.mark.slow
def test_sigkill_under_offload_and_activation_offload_then_resume_matches_every_parameter(
    uninterrupted_activation_offload, tmp_path
):
    """FPDT host offload + activation offload (checkpointed layers, their inputs on the host): rank 1
    SIGKILLed mid-step, resumed from the last checkpoint, every step's loss and every parameter as if
    nothing had happened."""
    _run_killed(tmp_path, "--activation-offload", "--kill-at", "3")
    _run_ok(tmp_path, "--activation-offload", "--resume")
    _assert_same_losses(_losses(tmp_path), uninterrupted_activation_offload.losses)
    _assert_same_params(_params(tmp_path), uninterrupted_activation_offload.params)


def _srun_like(out: Path, port: int, bin_dir: Path, *args: str) -> tuple[list[int], str]:
    """Start the 2 tasks of a faked one-node SLURM job the way srun would (Lightning does not launch)."""
    procs = []
    for rank in range(2):
        env = _env(
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="longctx",
            SLURM_NODELIST="localhost",
            MASTER_PORT=str(port),
            PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        )
        cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--max-steps", str(STEPS), *args]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    codes, outputs = [], []
    for rank, p in enumerate(procs):
        stdout, _ = p.communicate(timeout=300)
        codes.append(p.returncode)
        outputs.append(f"--- rank {rank} (exit {p.returncode}) ---\n{_tail(stdout)}")
    return codes, "\n".join(outputs)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "requeued"), [("SIGUSR1", True), ("SIGTERM", False)])
def test_slurm_signal_to_one_rank_checkpoints_requeues_and_resumes(uninterrupted, tmp_path, sig, requeued):
    """Rank 1 alone receives the signal in the middle of step 3. Both ranks save the committed checkpoint of
    step 4 (the next optimizer-step boundary), rank 0 runs `scontrol requeue` after SIGUSR1 only (SIGTERM is a
    cancellation, or a preemption SLURM requeues itself), both exit 0; no HPC checkpoint is written. The
    requeued job resumes from the newest committed checkpoint and ends as if nothing had happened."""
    from helpers.launch import free_port
    from lightning_longctx.lightning.checkpoint import commit_info, latest_checkpoint

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    codes, output = _srun_like(tmp_path, free_port(), bin_dir, "--signal-at", "3", "--signal", sig)
    assert codes == [0, 0], output
    log = tmp_path / "scontrol.log"
    assert (log.read_text().split() if log.exists() else []) == (["requeue", "4242"] if requeued else [])
    assert not list(tmp_path.rglob("hpc_ckpt_*")), "Lightning's in-handler save must not run"
    assert max(_losses(tmp_path)) == 3, "step 3 finishes, step 4 never starts"
    newest = latest_checkpoint(tmp_path)
    assert newest == tmp_path / "ckpt" / "step-00000004.ckpt", (newest, output)
    assert commit_info(newest)["global_step"] == 4
    assert not (tmp_path / "final_params.pt").exists(), "fit must not have ended normally"
    # the requeued job starts again: it resumes from the newest committed checkpoint
    codes, output = _srun_like(tmp_path, free_port(), bin_dir, "--resume")
    assert codes == [0, 0], output
    _assert_same_losses(_losses(tmp_path), uninterrupted.losses)
    _assert_same_params(_params(tmp_path), uninterrupted.params)
