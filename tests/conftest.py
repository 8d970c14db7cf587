"""Shared pytest fixtures.

Markers: ``e2e`` (starts Ray and verl's real trainer on CPU; slow) — skip them locally with ``-m "not e2e"``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("GTPO_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (set GTPO_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (e2e tests and Ray-based reward tests share it)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, num_gpus=1, include_dashboard=False, log_to_driver=True)
    yield ray
    # Left running until the interpreter exits: other session-scoped users may still need it.
