"""The launcher the tests share with the benchmarks lives in the package:
:mod:`lightning_longctx.testing.ranks` (``DistPool``, ``WarmPools``, ``launch``, ``process_groups``, ...).
The test modules import it from here."""

from __future__ import annotations

from lightning_longctx.testing.ranks import (  # noqa: F401  (re-exported for the test modules)
    DistPool,
    Launch,
    RanksFailed,
    WarmPools,
    free_port,
    launch,
    process_groups,
    rank_environment,
    run_spawned,
)
