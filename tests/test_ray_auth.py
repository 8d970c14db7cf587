"""Ray token authentication: the tests' two-node cluster is started the recipe's way (:mod:`gtpo.cpu.cluster`, a
fresh token in a private folder), and what joins it without the token is refused; the driver-side check says so at
once, naming the variable.

    .venv/bin/python -m pytest -q tests/test_ray_auth.py

The end-to-end runs of the suite join the same cluster with its token and train: a cluster that let everyone in
would pass them too, which is what the refusals here are for.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from gtpo.launch.ray_auth import check_ray_auth, ray_auth_problem
from tests.support.e2e import REPO_ROOT

_INIT = "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); print('JOINED', len(ray.nodes()))"


def _without_auth(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


@pytest.mark.e2e
def test_the_cluster_refuses_what_joins_without_its_token(ray_cluster, ray_session, tmp_path):
    """A driver (``ray.init`` to the GCS address) without a token, or with a wrong one, and a node (``ray start
    --address``) without the token are refused; a job POSTed to a node's dashboard agent is refused before it is
    read. The same driver with the cluster's token joins. (Ray's client retries for about 20 s before it gives up:
    the attempts run side by side.)"""
    from gtpo.cpu.cluster import ray_executable

    home = tmp_path / "home"  # no ~/.ray/auth_token to fall back on
    home.mkdir()
    wrong = tmp_path / "wrong"
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    attempts = {
        "no token": ([sys.executable, "-c", _INIT, ray_cluster.address], _without_auth(HOME=str(home))),
        "no mode, default token file": (
            [sys.executable, "-c", _INIT, ray_cluster.address], _without_auth()
        ),
        "wrong token": (
            [sys.executable, "-c", _INIT, ray_cluster.address],
            _without_auth(HOME=str(home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong)),
        ),
        "node without token": (
            [ray_executable(), "start", f"--address={ray_cluster.address}", "--node-ip-address=127.0.0.1",
             "--num-cpus=1", "--num-gpus=0", f"--temp-dir={tmp_path / 'rogue'}", "--disable-usage-stats"],
            _without_auth(HOME=str(home), RAY_AUTH_MODE="disabled"),
        ),
        "the cluster's token": ([sys.executable, "-c", _INIT, ray_cluster.address],
                                _without_auth(HOME=str(home), **ray_cluster.auth_env)),
    }  # fmt: skip
    nodes_before = sum(1 for n in ray_session.nodes() if n["Alive"])
    with ThreadPoolExecutor(len(attempts)) as pool:
        done = {name: pool.submit(_run, cmd, env) for name, (cmd, env) in attempts.items()}
        results = {name: future.result() for name, future in done.items()}
    joined = results.pop("the cluster's token")
    assert joined.returncode == 0 and f"JOINED {nodes_before}" in joined.stdout, joined.stderr[-2000:]
    for name, proc in results.items():
        assert proc.returncode != 0, f"{name}: joined the cluster\n{proc.stdout[-1000:]}"
        assert "JOINED" not in proc.stdout, name
    assert "InvalidAuthToken" in results["node without token"].stdout + results["node without token"].stderr
    assert sum(1 for n in ray_session.nodes() if n["Alive"]) == nodes_before  # no node joined

    # The dashboard agent's job API on a node: no token, no job.
    # A node whose agent listens: a node lists its port as -1 until its agent is up (minutes on a loaded machine), so
    # the test waits for one to list it; the bound only ends a failure.
    deadline = time.monotonic() + 300
    while True:
        nodes = [n for n in ray_session.nodes() if n["Alive"]]
        listening = [n for n in nodes if (n["DashboardAgentListenPort"] or 0) > 0]
        if listening or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert listening, f"no node of the cluster has a dashboard agent port after 300 s: {nodes}"
    node, port = listening[0], listening[0]["DashboardAgentListenPort"]
    url = f"http://{node['NodeManagerAddress']}:{port}/api/job_agent/jobs/"
    body = b'{"entrypoint": "touch /tmp/gtpo-planted", "submission_id": "rogue"}'
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=30)  # no proxy: a node
    assert refused.value.code == 401, refused.value.read()[:500]


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {"RAY_ADDRESS": "10.0.0.1:6379"},
            r"RAY_ADDRESS=10.0.0.1:6379 joins a running Ray cluster but RAY_AUTH_MODE is",
        ),
        ({"RAY_ADDRESS": "auto"}, r"RAY_AUTH_MODE is unset"),
        ({"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "Token"}, r"RAY_AUTH_MODE=Token: expected token or disabled"),
        ({"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "token"}, r"RAY_AUTH_TOKEN_PATH is unset"),
        (
            {"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/nonexistent/token"},
            r"RAY_AUTH_TOKEN_PATH=/nonexistent/token: no readable token file",
        ),
    ],
)
def test_a_driver_joining_without_its_token_is_refused_at_once(env, message):
    with pytest.raises(ValueError, match=message):
        check_ray_auth(env)


def test_a_token_path_that_is_a_folder_or_readable_by_others_is_refused(tmp_path):
    """Ray reads any file it is given and does not look at its mode (its own generator writes 0644): a token others
    may read lets them into the cluster; a folder is no token at all (as root it is "readable")."""
    joining = {"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "token"}
    with pytest.raises(ValueError, match=re.escape(f"RAY_AUTH_TOKEN_PATH={tmp_path}: not a file (mode drwx")):
        check_ray_auth({**joining, "RAY_AUTH_TOKEN_PATH": str(tmp_path)})
    shared = tmp_path / "auth_token"
    shared.write_text("a" * 64)
    for perms in (0o644, 0o640, 0o604):
        shared.chmod(perms)
        with pytest.raises(ValueError, match=re.escape(f"owned by uid {os.getuid()}, mode {perms:04o}; a token file")):
            check_ray_auth({**joining, "RAY_AUTH_TOKEN_PATH": str(shared)})
    shared.chmod(0o600)
    check_ray_auth({**joining, "RAY_AUTH_TOKEN_PATH": str(shared)})
    if os.getuid() == 0:
        os.chown(shared, 65534, -1)
        with pytest.raises(ValueError, match="owned by uid 65534"):
            check_ray_auth({**joining, "RAY_AUTH_TOKEN_PATH": str(shared)})


def test_what_the_driver_check_lets_through(tmp_path):
    token = tmp_path / "token"
    token.write_text("a" * 64)
    token.chmod(0o600)
    assert ray_auth_problem({}) is None  # a new local cluster: the entry point gives it a private token
    assert ray_auth_problem({"RAY_ADDRESS": "local"}) is None
    assert ray_auth_problem({"RAY_ADDRESS": " "}) is None and ray_auth_problem({"RAY_ADDRESS": "local\n"}) is None
    assert ray_auth_problem({"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "disabled"}) is None  # the explicit knob
    assert ray_auth_problem({"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}) is None
    assert ray_auth_problem({"RAY_ADDRESS": "h:1", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "v"}) is None


def test_the_entry_point_refuses_before_ray_starts(monkeypatch, tmp_path):
    """``prepare_config`` (the driver, before ``ray.init``) attached to a cluster without its token: a ValueError
    naming the variable, which the entry point prints as one line with the configuration-error exit; a dry run, which
    joins nothing, is not stopped."""
    import gtpo.verl_plugin.register  # noqa: F401
    from recipe.gtpo.main_gtpo import prepare_config
    from tests.support.configs import compose, data_overrides

    for key in [k for k in os.environ if k.startswith("RAY_AUTH")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")
    with pytest.raises(ValueError, match=r"RAY_ADDRESS=127.0.0.1:9 joins a running Ray cluster but RAY_AUTH_MODE is"):
        prepare_config(compose(["method=gtpo", "model=qwen2.5_7b"]))
    prepare_config(compose(["method=gtpo", "model=qwen2.5_7b"]), dry_run=True)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    prepare_config(compose(["method=gtpo", "model=qwen2.5_7b", *data_overrides(tmp_path)]))
