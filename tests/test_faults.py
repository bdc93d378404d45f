"""Surviving faults: a rank SIGKILLed under torchrun, and SLURM's SIGUSR1 -> checkpoint -> requeue.

Each run trains a tiny Llama with sp=2, FPDT chunking and host offload; after the restart the loss
of every remaining step must equal the uninterrupted run's (same batches, same parameters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _torchrun(out: Path, *args: str) -> int:
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
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300).returncode


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("full")
    assert _torchrun(out) == 0
    losses = _losses(out)
    assert sorted(losses) == list(range(STEPS))
    return losses


@pytest.mark.slow
def test_sigkill_one_rank_then_resume_matches(uninterrupted, tmp_path):
    assert _torchrun(tmp_path, "--kill-at", "3") != 0  # torchrun tears the job down when rank 1 dies
    assert max(_losses(tmp_path)) == 2
    assert _torchrun(tmp_path, "--resume") == 0
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(resumed[step] - uninterrupted[step]) < 1e-6, (step, resumed[step], uninterrupted[step])


def _srun_like(out: Path, port: int, bin_dir: Path, *args: str) -> list[int]:
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
    codes = []
    for p in procs:
        p.communicate(timeout=300)
        codes.append(p.returncode)
    return codes


@pytest.mark.slow
def test_slurm_sigusr1_checkpoints_requeues_and_resumes(uninterrupted, tmp_path):
    from _dist import free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    assert _srun_like(tmp_path, free_port(), bin_dir, "--usr1-at", "3") == [0, 0]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert list(tmp_path.glob("hpc_ckpt_*.ckpt")), "SIGUSR1 must leave an HPC checkpoint"
    # the requeued job starts again with the same command: Lightning resumes from the HPC checkpoint
    assert _srun_like(tmp_path, free_port(), bin_dir) == [0, 0]
    resumed = _losses(tmp_path)
    assert sorted(resumed) == list(range(STEPS))
    for step in range(STEPS):
        assert abs(resumed[step] - uninterrupted[step]) < 1e-6, (step, resumed[step], uninterrupted[step])
