from __future__ import annotations

import pytest
import torch

from lightning_longctx.testing import WarmPools

#: A warm gloo pool per world size (rebuilt when a previous test broke it): ``get_pool(world_size)``.
get_pool = WarmPools()


@pytest.fixture(scope="session")  # the same warm pools for every test (a module-scoped fixture may use them)
def dist_pool():
    return get_pool


def pytest_sessionfinish(session, exitstatus):
    get_pool.close()


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    """The test process itself never keeps a default process group between tests."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
