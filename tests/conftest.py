"""Shared pytest fixtures.

Markers: ``e2e`` (starts Ray and verl's real trainer on CPU) — skip them locally with ``-m "not e2e"``; ``slow``
(the long tier of trainer runs: the demo's 50 steps, each preset, the async resume, the evaluation script) — skipped
unless ``GTPO_SLOW_TESTS=1``. The default tier runs six trainer launches on a two-node cluster (most at world size
two), so the whole suite stays within 25 minutes on 2 cores; every trainer mode still runs through verl there (see
docs/tests.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SLOW_TESTS = os.environ.get("GTPO_SLOW_TESTS", "0") == "1"
SHARED_DATA = Path(os.environ.get("GTPO_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


# Tests that need the session's Ray cluster, that start a Ray cluster of their own (ray_host), that watch /dev/shm
# while trainer runs use it, or that start this host's one Slurm (two workers' Slurm daemons on one host stop each
# other's munged).
RAY_FIXTURES = {"ray_cluster", "ray_session", "ray_host", "slurm"}
SHM_MODULES = {"test_vllm_patches.py"}
# Where the xdist workers write the node ids of those tests for the controller's scheduler (set by the controller).
RAY_IDS_ENV = "GTPO_RAY_TEST_IDS"


def _uses_ray(item) -> bool:
    return "e2e" in item.keywords or bool(RAY_FIXTURES & set(item.fixturenames)) or item.path.name in SHM_MODULES


def _is_xdist_controller(config) -> bool:
    return not hasattr(config, "workerinput") and config.getoption("numprocesses", None) not in (None, 0)


def pytest_configure(config):
    if _is_xdist_controller(config):
        fd, path = tempfile.mkstemp(prefix="gtpo-ray-tests-")
        os.close(fd)
        os.environ[RAY_IDS_ENV] = path  # the workers start after this and inherit it


def pytest_unconfigure(config):
    if _is_xdist_controller(config):
        Path(os.environ.pop(RAY_IDS_ENV)).unlink(missing_ok=True)


def pytest_xdist_make_scheduler(config, log):
    """Every test that uses Ray goes to one worker, in collection order: that worker owns the session's one cluster
    (two Ray heads on one machine compete for Ray's fixed default ports, and two trainer runs for /dev/shm); the other
    worker takes everything else, one test at a time. (xdist's own ``loadgroup`` does this with a node-id suffix that
    pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayGroupScheduling(LoadScopeScheduling):
        ray_ids: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.ray_ids is None:
                self.ray_ids = set(Path(os.environ[RAY_IDS_ENV]).read_text().splitlines())
            return "ray" if nodeid in self.ray_ids else nodeid

    return RayGroupScheduling(config, log)


# Ray starts its workers at niceness 15 (its default worker_niceness): the trainer runs' processes would lose the
# cores to the other test worker's dry runs and starve. That worker takes the same niceness at its first test.
RAY_WORKER_NICENESS = 15


def pytest_runtest_setup(item):
    if hasattr(item.config, "workerinput") and not _uses_ray(item) and os.nice(0) < RAY_WORKER_NICENESS:
        os.nice(RAY_WORKER_NICENESS - os.nice(0))


def pytest_collection_modifyitems(config, items):
    ray_items = [item for item in items if _uses_ray(item)]
    # The Ray group first: it is the longest chain of the run.
    items[:] = ray_items + [item for item in items if not _uses_ray(item)]
    ids_path = os.environ.get(RAY_IDS_ENV)
    if ids_path and hasattr(config, "workerinput"):
        # every worker collects the same items: write atomically, the last writer wins with the same text
        part = Path(f"{ids_path}.{config.workerinput['workerid']}")
        part.write_text("\n".join(item.nodeid for item in ray_items))
        os.replace(part, ids_path)
    if SLOW_TESTS:
        return
    skip = pytest.mark.skip(reason="slow tier: set GTPO_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ray_host():
    """A test that starts a Ray cluster of its own on this host: it runs in the Ray group, one at a time with the
    others that start Ray (:data:`RAY_FIXTURES`)."""
    return None


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set GTPO_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_assets():
    """The CPU backend's offline tiny Qwen2, tokenizer and data (gtpo.cpu.tiny_assets; built once, cached on disk)."""
    from gtpo.cpu.tiny_assets import build_tiny_assets

    return build_tiny_assets()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """The session's one Ray cluster: two simulated nodes (a head and one more raylet, one logical GPU each) shared
    by the end-to-end runs and the Ray-based tests."""
    from tests.support.e2e import RayCluster

    # Ray's socket paths must stay within AF_UNIX's 107 bytes: a short folder of its own, not pytest's basetemp.
    root = Path(tempfile.mkdtemp(prefix="gtpo-ray-"))
    temp_dir = root / "t"
    temp_dir.mkdir()
    head = RayCluster(temp_dir)
    try:
        head.start()
        # What joins it from this process or a child (a driver, the demo, a preStop hook) carries its token.
        os.environ.update(head.auth_env)
        yield head
    finally:
        head.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """This test process connected, as a Ray driver, to the session's cluster."""
    import ray

    if not ray.is_initialized():
        from ray._raylet import AuthenticationTokenLoader, Config

        # Ray reads RAY_AUTH_MODE and the token once per process: reload both, as its own ray.init does after it
        # turns authentication on (ray/_private/authentication/authentication_token_setup.py)
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
        ray.init(address=ray_cluster.address, log_to_driver=False)
    yield ray
    ray.shutdown()
