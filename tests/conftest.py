from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _dist import DistPool

_POOLS: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    """A warm gloo pool of ``world_size`` ranks; rebuilt when a previous test broke it."""
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = DistPool(world_size)
    return pool


@pytest.fixture
def dist_pool():
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """The test process itself never keeps a default process group between tests."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
