"""A run that names no Ray cluster starts its own, private one (``gtpo.launch.local_ray``), never the cluster Ray's
temp folder records: ``<tmp>/ray/ray_current_cluster`` is a file any local user can write.

    .venv/bin/python -m pytest -q -n 0 tests/test_local_ray.py

The last test starts a real local Ray in a child process, with a cluster "another user" recorded and Ray's shared
``~/.ray/auth_token`` in place: nothing connects to the recorded address, the session lives in a private folder and
the shared token file is neither read nor rewritten.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gtpo.launch.local_ray import names_a_cluster, start_private_local_ray

RAY_VARS = ("RAY_ADDRESS", "RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


@pytest.fixture
def clean_env(monkeypatch):
    """No Ray variables (restored afterwards), temporary folders in a short one of the test's own."""
    for name in RAY_VARS:
        monkeypatch.setenv(name, "x")  # recorded, so that what the code sets is undone
        monkeypatch.delenv(name)
    short = Path(tempfile.mkdtemp(prefix="lr-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    yield short
    shutil.rmtree(short, ignore_errors=True)


def planted_record(tmp_path: Path, address: str) -> Path:
    """``<RAY_TMPDIR>/ray/ray_current_cluster`` naming ``address``, in a folder everyone may write, as Ray makes it."""
    ray_dir = tmp_path / "shared-tmp" / "ray"
    ray_dir.mkdir(parents=True)
    ray_dir.chmod(0o777)
    (ray_dir / "ray_current_cluster").write_text(address)
    return ray_dir.parent


def test_a_run_naming_no_cluster_gets_a_private_folder_and_token(clean_env, monkeypatch, capsys):
    from ray._private.services import canonicalize_bootstrap_address

    monkeypatch.setenv("RAY_TMPDIR", str(planted_record(clean_env, "192.0.2.2:6379")))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "inherited-value")
    assert canonicalize_bootstrap_address(None) == "192.0.2.2:6379"  # what a plain ray.init() would join
    folder = start_private_local_ray({"num_cpus": None})
    assert os.environ["RAY_ADDRESS"] == "local" and canonicalize_bootstrap_address(None) is None
    assert os.environ["RAY_TMPDIR"] == str(folder) and folder.parent == clean_env
    st = folder.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert os.environ["RAY_AUTH_MODE"] == "token" and token.parent.parent == folder
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert "RAY_AUTH_TOKEN" not in os.environ  # a value would reach every process of the cluster
    err = capsys.readouterr().err
    assert f"session logs under {folder}/ray" in err and "set RAY_ADDRESS to join a running cluster" in err
    # each run its own folder and token
    second = start_private_local_ray({})
    assert second != folder and Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text() != token.read_text()


@pytest.mark.parametrize(
    "environ,ray_init,joins",
    [
        ({}, {}, False),
        ({"RAY_ADDRESS": "local"}, {}, False),
        ({"RAY_ADDRESS": " "}, {}, False),
        ({"RAY_ADDRESS": "local\n"}, {}, False),
        ({"RAY_ADDRESS": "10.0.0.1:6379"}, {}, True),  # Slurm, a RayJob's driver, a cluster on purpose
        ({}, {"address": "10.0.0.1:6379"}, True),  # ray_kwargs.ray_init.address
        ({}, {"address": None}, False),
    ],
)
def test_only_a_named_cluster_is_joined(environ, ray_init, joins, clean_env):
    assert names_a_cluster(environ, ray_init) is joins
    env = dict(environ)
    folder = start_private_local_ray(ray_init, env)
    assert (folder is None) is joins
    assert env == environ if joins else env["RAY_ADDRESS"] == "local"
    assert "RAY_ADDRESS" not in os.environ  # the mapping given, not this process's


def test_the_entry_point_starts_it_before_verls_run(clean_env, monkeypatch):
    """``train`` (what a real run calls once its config passed): verl's ``run_ppo`` finds the private cluster's
    variables, unless the run names a cluster."""
    from recipe.gtpo import main_gtpo

    seen = {}
    monkeypatch.setattr(main_gtpo, "run_preemptible", lambda config: seen.update(os.environ) or 0)
    assert main_gtpo.train(OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 4}}})) == 0
    assert seen["RAY_ADDRESS"] == "local" and Path(seen["RAY_TMPDIR"]).parent == clean_env
    assert seen["RAY_AUTH_MODE"] == "token" and seen["RAY_AUTH_TOKEN_PATH"].startswith(seen["RAY_TMPDIR"])
    seen.clear()
    for name in ("RAY_ADDRESS", "RAY_TMPDIR", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name)
    named = OmegaConf.create({"ray_kwargs": {"ray_init": {"address": "10.0.0.1:6379"}}})
    assert main_gtpo.train(named) == 0
    assert not {"RAY_ADDRESS", "RAY_TMPDIR", "RAY_AUTH_MODE"} & set(seen)  # joining the cluster it names


LOCAL_RUN = """
import ray
from gtpo.launch.local_ray import start_private_local_ray
folder = start_private_local_ray({})
ctx = ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
print("SESSION", ctx.address_info["session_dir"], flush=True)
print("TASK", ray.get(ray.remote(lambda: 1 + 1).remote()), flush=True)
ray.shutdown()
"""


def test_a_real_local_run_never_contacts_the_recorded_cluster(tmp_path, ray_host):
    """Row 42-44 of the security review, end to end: another user's listener recorded as the current cluster, and a
    0644 ``~/.ray/auth_token`` of Ray's own in HOME. The run's Ray starts and runs a task; the listener is never
    contacted, the session folder is inside a 0700 folder, the shared token file is untouched."""
    received = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    received.append(listener.accept()[0])
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        shared_tmp = planted_record(tmp_path, f"127.0.0.1:{listener.getsockname()[1]}")
        home = tmp_path / "home"
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("f" * 64)
        (home / ".ray" / "auth_token").chmod(0o644)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HOME=str(home), RAY_TMPDIR=str(shared_tmp), TMPDIR="/tmp", RAY_USAGE_STATS_ENABLED="0")
        proc = subprocess.run(
            [sys.executable, "-c", LOCAL_RUN], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        stop.set()
        thread.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TASK 2" in proc.stdout
    assert received == []  # nothing, not even a connection, reached the recorded address
    session = Path(proc.stdout.split("SESSION ")[1].split()[0])
    private = session.parent.parent
    assert private.parent == Path("/tmp") and private.name.startswith("gtpo-ray-"), session
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.getuid()
    assert (home / ".ray" / "auth_token").read_text() == "f" * 64
    assert sorted(p.name for p in (home / ".ray").iterdir()) == ["auth_token"]
    assert not (private / "auth").exists()  # the token goes with the driver; the session's logs stay
    shutil.rmtree(private)


def test_the_token_folder_is_private_too(clean_env):
    """The token's own folder is 0700 like the run's folder around it: nobody else may list it or read the token."""
    env: dict[str, str] = {}
    folder = start_private_local_ray({}, env)
    token = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert token.parent == folder / "auth" and stat.S_IMODE(token.parent.stat().st_mode) == 0o700


def test_a_long_temp_folder_gives_way_to_tmp(clean_env, monkeypatch):
    """Under a job's long ``TMPDIR`` Ray's socket paths would pass 107 bytes: the run's folder goes to /tmp once the
    folder's own path would pass 36 characters (here 45)."""
    long = clean_env / ("x" * 10)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    env: dict[str, str] = {}
    folder = start_private_local_ray({}, env)
    try:
        assert folder.parent == Path("/tmp") and env["RAY_TMPDIR"] == str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
