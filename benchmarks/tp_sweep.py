"""Tensor parallelism over the architecture sweep: every dense model the sweep runs exactly, one Trainer step
at world 4 = sequence parallel 2 x tensor parallel 2 (FSDP2), against the single-process loop.

    python benchmarks/tp_sweep.py                  # both modes, the plan styles the package accepts
    python benchmarks/tp_sweep.py --archs llama,phi3 --modes fpdt

The sweep is ``tests/fuzz_tp_sweep.py`` (flags, output: its ``--help``): it runs the test modules' Trainer
step (``tests/fuzz_strategy.py``) over the architecture sweep (``tests/arch_sweep.py``), which import each
other by name, so it lives beside them. This script runs it there, in place of this process, with the same
arguments.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SWEEP = Path(__file__).resolve().parents[1] / "tests" / "fuzz_tp_sweep.py"

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, str(SWEEP), *sys.argv[1:]])
