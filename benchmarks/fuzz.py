"""Long randomized differential searches: the strategies of ``tests/test_fuzz.py``, many more trials.

    python benchmarks/fuzz.py --trials 2000 --seed 1                 # the attention core
    python benchmarks/fuzz.py --target strategy --trials 50 --seed 1  # one Trainer step per trial

The search is ``tests/fuzz_search.py`` (flags, output: its ``--help``): it draws from the test modules'
strategies (``tests/fuzz_attention.py``, ``tests/fuzz_strategy.py``), which import each other by name, so it
lives beside them. This script runs it there, in place of this process, with the same arguments.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SEARCH = Path(__file__).resolve().parents[1] / "tests" / "fuzz_search.py"

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, str(SEARCH), *sys.argv[1:]])
