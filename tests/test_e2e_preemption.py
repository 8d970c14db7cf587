"""Preemption on the real trainer (sync mode, world size two on the session's two simulated nodes).

    .venv/bin/python -m pytest -n 0 -q tests/test_e2e_preemption.py

SIGUSR1 to the driver after step 2 of a run without periodic saves: the run saves the step in flight and ends by
itself with exit 85 (the trackers flushed). ``resume_mode=auto`` continues from that checkpoint; after its first step
the cluster-wide request of a Kubernetes preStop hook (``python -m gtpo.trainer.preemption request --wait``)
stops it the same way, the hook returning once the trainer has saved; the metric log holds every step of both runs
once.

Other modes: tests/test_e2e_separate_async.py (SIGTERM, twice), tests/test_slurm_preemption.py (a real Slurm's
deadline under colocate_async, the requeue and the resume).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from gtpo.trainer.preemption.stop import EXIT_CODE
from gtpo.trainer.resume.checkpoints import TRACKER_FILE, CheckpointLayout, incomplete_reasons
from tests.support.e2e import REPO_ROOT, WORLD_SIZE_2, RunningRecipe, base_overrides, read_metrics, shard_names, tail

# slow tier: the default tier keeps preemption under a real Slurm (tests/test_slurm_preemption.py: the time-limit
# warning, exit 85, the requeue and the resume) and stays within its 25 minutes
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_sigusr1_then_a_prestop_request_each_save_the_step_in_flight_and_exit_85(ray_cluster, tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    metrics_path = tmp_path / "run.metrics.jsonl"
    overrides = base_overrides(tiny_assets) + [
        *WORLD_SIZE_2,
        "method=gtpo",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=-1",  # no periodic save: the stop's is the only checkpoint
        "trainer.total_training_steps=8",
    ]
    first = RunningRecipe(ray_cluster, tmp_path, overrides, name="run", log_env=None)
    first.wait_until(lambda: len(read_metrics(metrics_path)) >= 2, timeout=600)
    os.kill(first.proc.pid, signal.SIGUSR1)
    rc = first.proc.wait(timeout=300)
    log = first.log
    assert rc == EXIT_CODE, tail(log)
    stopped = [r["step"] for r in read_metrics(metrics_path)][-1]
    assert 2 <= stopped < 8
    assert [r["step"] for r in read_metrics(metrics_path)] == list(range(1, stopped + 1))
    assert f"stopped after step {stopped} (SIGUSR1 to the driver" in log, tail(log)
    # a complete checkpoint of the last finished step, both ranks' shards, the tracker pointing at it
    folder = ckpt / f"global_step_{stopped}"
    assert (ckpt / TRACKER_FILE).read_text().strip() == str(stopped)
    assert incomplete_reasons(str(folder), stopped, CheckpointLayout()) == []
    assert shard_names(folder / "actor") == sorted(
        f"{kind}_world_size_2_rank_{rank}.pt" for kind in ("extra_state", "model", "optim") for rank in (0, 1)
    )

    # The resumed run continues from that checkpoint; after its first step, the cluster-wide request of a Kubernetes
    # preStop hook stops it the same way, and the hook's --wait returns once the trainer has saved.
    resumed = RunningRecipe(ray_cluster, tmp_path, overrides + ["trainer.resume_mode=auto"], name="resumed",
                            log_env={"VERL_FILE_LOGGER_PATH": str(metrics_path)})  # fmt: skip
    resumed.wait_until(lambda: len(read_metrics(metrics_path)) > stopped, timeout=600)
    hook = subprocess.run(
        [sys.executable, "-m", "gtpo.trainer.preemption", "request", f"--address={ray_cluster.address}",
         "--wait=300"],
        cwd=REPO_ROOT, env={**os.environ, **ray_cluster.auth_env}, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    assert hook.returncode == 0, hook.stderr[-3000:]
    assert "the trainer saved (step " in hook.stderr, hook.stderr[-3000:]
    assert resumed.proc.wait(timeout=300) == EXIT_CODE, tail(resumed.log)
    assert f"resumed from {folder} at step {stopped}" in resumed.log, tail(resumed.log)
    again = [r["step"] for r in read_metrics(metrics_path)][-1]
    assert stopped < again < 8
    assert f"stopped after step {again} (python -m gtpo.trainer.preemption request)" in resumed.log
    assert incomplete_reasons(str(ckpt / f"global_step_{again}"), again, CheckpointLayout()) == []
    # every step of both runs in the metric log once
    assert [r["step"] for r in read_metrics(metrics_path)] == list(range(1, again + 1))
