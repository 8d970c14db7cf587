"""Shared pytest fixtures.

Markers: ``e2e`` (starts Ray and verl's real trainer on CPU) — skip them locally with ``-m "not e2e"``; ``slow``
(the long tier of trainer runs: the demo's 50 steps, each preset, the async resume, the evaluation script) — skipped
unless ``GTPO_SLOW_TESTS=1``. The default tier runs six trainer launches, so the whole suite stays within 25 minutes
on 2 cores; every method and trainer mode still runs through verl there (see README, "Tests").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SLOW_TESTS = os.environ.get("GTPO_SLOW_TESTS", "0") == "1"
SHARED_DATA = Path(os.environ.get("GTPO_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def pytest_collection_modifyitems(config, items):
    if SLOW_TESTS:
        return
    skip = pytest.mark.skip(reason="slow tier: set GTPO_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set GTPO_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """The session's one Ray cluster: a local head shared by the end-to-end runs and the Ray-based tests."""
    from tests.e2e_support import RayCluster

    temp_dir = tmp_path_factory.mktemp("ray") / "t"
    temp_dir.mkdir()
    head = RayCluster(temp_dir)
    head.start()
    yield head
    head.stop()


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """This test process connected, as a Ray driver, to the session's cluster."""
    import ray

    if not ray.is_initialized():
        os.environ["RAY_AUTH_MODE"] = "disabled"
        ray.init(address=ray_cluster.address, log_to_driver=False)
    yield ray
    ray.shutdown()
