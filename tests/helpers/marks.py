"""pytest marks the test modules share."""

from __future__ import annotations

import os

import pytest

#: 8 processes on 2 cores (a few minutes of the suite's 20): opt-in with ``LONGCTX_WORLD8=1`` (the long runs
#: before a release and any machine with 8 cores run them); the world-2 and world-4 cases stay in every run
WORLD8 = pytest.mark.skipif(
    not os.environ.get("LONGCTX_WORLD8"), reason="world 8 on 2 cores: LONGCTX_WORLD8=1 runs it"
)
