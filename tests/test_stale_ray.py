"""A crashed cluster recorded in Ray's temp folder does not capture the next single-node launch
(``skip_dead_recorded_cluster`` in recipe/gtpo/main_gtpo.py). No Ray starts here: a dead address refuses at once.

    .venv/bin/pytest -q -p no:cacheprovider tests/test_stale_ray.py
"""

from __future__ import annotations

import os
import socket

import pytest
from omegaconf import OmegaConf


@pytest.fixture
def ray_dir(monkeypatch, tmp_path):
    """Ray's temp folder (``$RAY_TMPDIR/ray``, where ``ray start`` records its cluster), no RAY_ADDRESS."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def record(ray_dir, address: str) -> None:
    (ray_dir / "ray_current_cluster").write_text(address)


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def said(capsys) -> list[str]:
    """The recipe's lines on stderr."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("gtpo:")]


def config(**ray_init):
    return OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": None, **ray_init}}})


def test_a_dead_recorded_cluster_is_not_joined(ray_dir, capsys):
    from ray._private.services import canonicalize_bootstrap_address

    from recipe.gtpo.main_gtpo import skip_dead_recorded_cluster

    record(ray_dir, f"127.0.0.1:{dead_port()}")
    dead = canonicalize_bootstrap_address(None)
    assert dead is not None  # what a plain ray.init() joins (and, with ray_init.num_cpus set, is refused by)

    line = skip_dead_recorded_cluster(config())
    assert os.environ["RAY_ADDRESS"] == "local"
    assert canonicalize_bootstrap_address(None) is None  # ray.init() now starts a new local instance
    assert said(capsys) == [line]  # one line (Ray may warn of other clusters on this machine besides)
    assert dead in line and "RAY_ADDRESS=local" in line


def test_a_live_recorded_cluster_is_still_joined(ray_dir, capsys):
    """A ``ray start`` on this node: its GCS port accepts (Ray's GCS listens on every interface)."""
    from recipe.gtpo.main_gtpo import skip_dead_recorded_cluster

    with socket.create_server(("", 0)) as gcs:
        record(ray_dir, f"127.0.0.1:{gcs.getsockname()[1]}")
        assert skip_dead_recorded_cluster(config()) is None
    assert "RAY_ADDRESS" not in os.environ and said(capsys) == []


def test_an_address_given_or_none_recorded_is_left_alone(ray_dir, monkeypatch, capsys):
    from recipe.gtpo.main_gtpo import skip_dead_recorded_cluster

    assert skip_dead_recorded_cluster(config()) is None  # nothing recorded: ray.init starts its own
    assert "RAY_ADDRESS" not in os.environ
    record(ray_dir, f"127.0.0.1:{dead_port()}")
    assert skip_dead_recorded_cluster(config(address="10.0.0.1:6379")) is None  # +ray_kwargs.ray_init.address
    assert "RAY_ADDRESS" not in os.environ
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # Slurm, a RayJob's driver, a cluster on purpose
    assert skip_dead_recorded_cluster(config()) is None and os.environ["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert said(capsys) == []
    # a garbled record, which ray.init() would refuse: a new local Ray as well
    monkeypatch.delenv("RAY_ADDRESS")
    record(ray_dir, "not-an-address")
    assert skip_dead_recorded_cluster(config()) and os.environ["RAY_ADDRESS"] == "local"


def test_the_entry_point_skips_it_before_ray_starts(ray_dir, monkeypatch):
    """``prepare_config`` of a real run (what runs before verl's ``run_ppo``); a dry run starts no Ray."""
    import gtpo.verl_plugin.register  # noqa: F401
    from recipe.gtpo.main_gtpo import prepare_config
    from tests.support.configs import compose

    for key in [k for k in os.environ if k.startswith("RAY_AUTH")]:
        monkeypatch.delenv(key)
    record(ray_dir, f"127.0.0.1:{dead_port()}")
    cfg = compose(["method=gtpo", "model=qwen2.5_7b"])
    prepare_config(cfg.copy(), dry_run=True)
    assert "RAY_ADDRESS" not in os.environ
    prepare_config(cfg)
    assert os.environ["RAY_ADDRESS"] == "local"
