"""scripts/k8s/rayjob.yaml's head preStop hook, run as Kubernetes runs it (its exact command line, parsed from the
manifest), and how long the finished job keeps its GPUs.

    .venv/bin/python -m pytest -q tests/test_k8s_lifecycle.py

The hook used to be ``bash -c "pkill -USR1 -f 'm recipe.gtpo.main_gtpo' ..."``: ``pkill -f`` matched the hook's own
shell (its command line holds the pattern), which died of SIGUSR1 before the driver had saved. Here, on the session's
Ray cluster, a stand-in driver named as the driver is (``python -m recipe.gtpo.main_gtpo``) polls the stop channel
the trainer polls (:class:`gtpo.trainer.preemption.stop.TrainerStop`: the job's key and the cluster key in Ray's
key-value store) and announces its save as the trainer does; the hook's request stops it, the hook survives its own
pattern and returns after the stand-in has exited. With no trainer on the cluster (a finished job's cluster being
deleted) both hooks return at once instead of holding the GPUs for their whole wait; with a trainer that is saving,
the request waits until the save is announced. Not covered: the trainer's own steps and save (a real trainer stopped
by the workers' same request: tests/test_e2e_preemption.py), KubeRay and the pod's SIGTERM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "scripts" / "k8s" / "rayjob.yaml"
VENV_BIN = Path(sys.executable).parent


def job() -> dict:
    (rayjob,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayJob"]
    return rayjob


def head_hook() -> list[str]:
    head = job()["spec"]["rayClusterSpec"]["headGroupSpec"]
    (container,) = head["template"]["spec"]["containers"]
    return container["lifecycle"]["preStop"]["exec"]["command"]


def test_the_finished_job_frees_its_gpus_within_minutes():
    spec = job()["spec"]
    # the logs are on the checkpoint volume: an hour's wait held 32 GPUs for nothing after every end
    assert spec["shutdownAfterJobFinishes"] is True and 0 < spec["ttlSecondsAfterFinished"] <= 600


def worker_hook() -> list[str]:
    (workers,) = job()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    return worker["lifecycle"]["preStop"]["exec"]["command"]


def test_the_head_hook_asks_as_the_workers_do():
    (workers,) = job()["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    (worker,) = workers["template"]["spec"]["containers"]
    request = " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
    assert request == "python -m gtpo.trainer.preemption request --address=auto --wait=1440"
    assert request in head_hook()[-1]


STAND_IN = """
import sys, time
from pathlib import Path

import ray

from gtpo.knobs import PreemptionParams
from gtpo.trainer.preemption.presence import TrainerPresence
from gtpo.trainer.preemption.stop import TrainerStop

out = Path(sys.argv[-1])
ray.init(log_to_driver=False)  # RAY_ADDRESS: the session's cluster, as the driver on the head joins its own
stop = TrainerStop(PreemptionParams(deadline="none"))
presence = TrainerPresence().start()  # as the trainer's fit() does while it runs
(out / "ready").touch()
while (reason := stop._requests()) is None:  # what the trainer reads after every step
    time.sleep(0.2)
(out / "reason").write_text(reason)
while not (out / "save").exists():  # the save takes as long as the test says
    time.sleep(0.2)
stop._announce("step 1 in the stand-in")  # the trainer's "save complete", which `request --wait` waits for
presence.stop()
time.sleep(4)  # the trainer flushes its trackers, the driver exits 85 (longer than `request --wait`'s 2-s poll)
(out / "exited").write_text(repr(time.time()))
sys.exit(85)
"""


def _clear_presence(ray_session) -> None:
    """No record of an earlier test's trainer (a killed one's lives on for its TTL) on the session's cluster."""
    from gtpo.trainer.preemption.channel import delete_key, keys_with_prefix
    from gtpo.trainer.preemption.presence import PRESENCE_PREFIX

    for key in keys_with_prefix(PRESENCE_PREFIX):
        delete_key(key)


def _start_stand_in(tmp_path, env) -> subprocess.Popen:
    pkg = tmp_path / "standin" / "recipe" / "gtpo"  # `python -m recipe.gtpo.main_gtpo`, named as the driver is
    pkg.mkdir(parents=True)
    for folder in (pkg, pkg.parent):
        (folder / "__init__.py").touch()
    (pkg / "main_gtpo.py").write_text(textwrap.dedent(STAND_IN))
    driver = subprocess.Popen(
        [sys.executable, "-m", "recipe.gtpo.main_gtpo", str(tmp_path)],
        cwd=tmp_path / "standin",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[0][-3000:]
        time.sleep(0.2)
    return driver


def _env(ray_cluster) -> dict[str, str]:
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "RAY_ADDRESS": ray_cluster.address}


@pytest.mark.parametrize("hook", [head_hook, worker_hook], ids=["head", "worker"])
def test_without_a_trainer_the_hooks_return_at_once(ray_cluster, ray_session, hook):
    """A finished job's cluster being deleted: nothing would save, so no hook holds its pod's GPUs for --wait=1440
    (the head's does not wait for a driver either)."""
    _clear_presence(ray_session)
    result = subprocess.run(hook(), env=_env(ray_cluster), capture_output=True, text=True, timeout=300)
    assert result.returncode == 4, (result.returncode, result.stderr[-3000:])
    assert "no gtpo trainer runs on the cluster: nothing to save, not waiting" in result.stderr, result.stderr


def test_the_request_waits_for_a_trainer_that_is_saving(ray_cluster, ray_session, tmp_path):
    """The stand-in saves only when the test says so: the request is still waiting then, and returns on the save."""
    _clear_presence(ray_session)
    env = _env(ray_cluster)
    driver = _start_stand_in(tmp_path, env)
    request = None
    try:
        request = subprocess.Popen(worker_hook(), env=env, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in request.stderr:
            lines.append(line)
            if "waiting for the save of" in line:
                break
        assert "waiting for the save of" in "".join(lines), "".join(lines)
        while not (tmp_path / "reason").exists():  # the stand-in has read the request: it is "saving"
            assert driver.poll() is None, driver.communicate()[0][-3000:]
            time.sleep(0.2)
        (tmp_path / "save").touch()
        rest = request.stderr.read()
        assert request.wait(timeout=120) == 0, "".join(lines) + rest
        assert "gtpo preemption: the trainer saved (step 1 in the stand-in)" in rest, rest
        assert driver.wait(timeout=60) == 85
    finally:
        for proc in (driver, request):
            if proc is not None and proc.poll() is None:
                proc.kill()


def test_a_record_counts_until_it_expires(monkeypatch):
    from gtpo.trainer.preemption import presence

    store = {"trainer/01000000": {"host": "head", "pid": 7, "expires": 100.0}}
    monkeypatch.setattr(presence, "keys_with_prefix", lambda prefix: [k for k in store if k.startswith(prefix)])
    monkeypatch.setattr(presence, "get_value", store.get)
    assert presence.live_trainers(now=lambda: 99.0) == ["01000000 on head (pid 7)"]
    assert presence.live_trainers(now=lambda: 100.0) == []


def test_the_head_hook_stops_a_driver_on_the_cluster_and_returns_after_its_exit(ray_cluster, ray_session, tmp_path):
    _clear_presence(ray_session)
    env = _env(ray_cluster)
    (tmp_path / "save").touch()  # the stand-in saves at once
    driver = _start_stand_in(tmp_path, env)
    try:
        hook = subprocess.run(head_hook(), env=env, capture_output=True, text=True, timeout=300)
        returned = time.time()
        assert driver.wait(timeout=60) == 85, driver.communicate()[0][-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    assert hook.returncode == 0, (hook.returncode, hook.stderr[-3000:])
    assert "gtpo preemption: the trainer saved (step 1 in the stand-in)" in hook.stderr, hook.stderr[-3000:]
    assert (tmp_path / "reason").read_text() == "python -m gtpo.trainer.preemption request"
    assert returned >= float((tmp_path / "exited").read_text())  # after the driver's exit, not only its save
