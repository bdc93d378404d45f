"""Helpers for testing and benchmarking code built on lightning_longctx: start ranks, build tiny models,
record results. The package's tests and its benchmark scripts use them; so may yours.

* :mod:`~lightning_longctx.testing.ranks`: real processes with real ``torch.distributed``. A warm gloo
  :class:`DistPool` (and :class:`WarmPools`, one per world size) runs any picklable function on every rank;
  :func:`launch` runs one call on fresh processes with the variables torchrun sets (the caller picks the
  backend); :func:`process_groups` destroys what a function built on a warm pool's ranks.
* :mod:`~lightning_longctx.testing.hf_models`: tiny Hugging Face models from configs (:func:`tiny_model`),
  token data, a plain LightningModule and the single-process loop a parallel run is compared with
  (``hf_models.ARCHS``: the architectures; ``hf_models.TINY_LLAMA``: a tiny Llama's config as a dict).
* :mod:`~lightning_longctx.testing.results`: :func:`environment` (versions, machine, command line),
  :func:`write_json`, :func:`format_table`, :func:`meminfo_bytes`, :func:`linear_fit` (and the units
  ``results.MIB``, ``results.GIB``).
* :mod:`~lightning_longctx.testing.sabotage`: negative checks, a check shown to fail on a broken version.
  :class:`Sabotage` (a deliberate bug: one attribute replaced while entered, picklable to a pool's ranks),
  :func:`sabotaged` (a function run under it), :func:`assert_catches` / :func:`assert_error_above` (the
  check must fail under it).

For tests and benchmarks only: no module of the package imports this one (``tests/test_house_rules.py``).
"""

from __future__ import annotations

from lightning_longctx.testing.hf_models import (
    HFModule,
    TokenDataset,
    checkpointing_state,
    reference_training,
    tiny_config,
    tiny_model,
)
from lightning_longctx.testing.ranks import (
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
from lightning_longctx.testing.results import (
    environment,
    format_table,
    linear_fit,
    meminfo_bytes,
    write_json,
)
from lightning_longctx.testing.sabotage import Sabotage, assert_catches, assert_error_above, sabotaged

__all__ = [
    "DistPool",
    "HFModule",
    "Launch",
    "RanksFailed",
    "Sabotage",
    "TokenDataset",
    "WarmPools",
    "assert_catches",
    "assert_error_above",
    "checkpointing_state",
    "environment",
    "format_table",
    "free_port",
    "launch",
    "linear_fit",
    "meminfo_bytes",
    "process_groups",
    "rank_environment",
    "reference_training",
    "run_spawned",
    "sabotaged",
    "tiny_config",
    "tiny_model",
    "write_json",
]
