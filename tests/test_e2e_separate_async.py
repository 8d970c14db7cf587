"""verl 0.9.1's separate asynchronous trainer on CPU: the trainer pool on one simulated node, the standalone rollout
pool on the other, the weights crossing between them over the CPU checkpoint engine (``gtpo.cpu.checkpoint_engine``,
picked by ``configs/backend/trainer/cpu_tiny_separate_async.yaml``).

    .venv/bin/python -m pytest -q -m e2e tests/test_e2e_separate_async.py

1. GTPO, two ``parameter_sync_step`` slices per step, a checkpoint every 2 steps keeping one; SIGTERM to the driver
   after step 3 (and again while it saves): the run saves the step in flight, ends by itself with exit 85, and
   ``resume_mode=auto`` continues to step 6. Checked on the way: where Ray placed the two pools, staleness (the
   standalone pool generates ahead with the weights of the last sync), the estimator's slice (rows and groups per
   call, two calls per step), the weights reaching the standalone replica at every sync (the bytes each side of the
   CPU engine counted), ``transfer_queue/`` saved with each checkpoint and gone with its actor, the resumed run's
   steps once each.
2. The same trainer with the standalone pool's weight receiver stopped after step 1 (a wedged replica): the next
   sync waits on it, and the watchdog ends the run within ``algorithm.watchdog.weight_sync_s``, naming the
   standalone stage and stopping the standalone pool too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest

from gtpo.trainer.preemption.stop import EXIT_CODE as PREEMPTED_EXIT
from gtpo.trainer.resume.checkpoints import TRACKER_FILE, CheckpointLayout, incomplete_reasons
from tests.support.e2e import (
    RunningRecipe,
    RunResult,
    actor_table,
    base_overrides,
    placement,
    process_ids,
    read_metrics,
    run_recipe,
    tail,
)

pytestmark = pytest.mark.e2e

SEPARATE = [
    "trainer=separate_async",
    "method=gtpo",
    "algorithm.filter_groups.enable=false",
    # two slices of one prompt group per step: the estimator sees a slice, the weights sync after each step
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    "trainer.v1.separate_async.parameter_sync_step=2",
    # the CPU engine logs each sync's bytes at INFO
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_LOGGING_LEVEL=INFO",
]


def test_separate_async_on_two_nodes_checkpoints_stops_on_sigterm_and_resumes(
    ray_cluster, ray_session, tiny_assets, tmp_path
):
    ckpt = tmp_path / "ckpt"
    metrics_path = tmp_path / "run.metrics.jsonl"
    common = base_overrides(tiny_assets) + [
        *SEPARATE,
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
        "trainer.max_actor_ckpt_to_keep=1",
        "trainer.total_training_steps=6",
    ]
    before = actor_table()
    running = RunningRecipe(ray_cluster, tmp_path, common, name="run", log_env=None)
    running.wait_until(lambda: len(read_metrics(metrics_path)) >= 3, timeout=600)
    os.kill(running.proc.pid, signal.SIGTERM)
    # a second SIGTERM a second later, while the step in flight finishes and saves: it changes nothing
    time.sleep(1.0)
    assert running.proc.poll() is None, tail(running.log)
    os.kill(running.proc.pid, signal.SIGTERM)
    rc = running.proc.wait(timeout=300)
    first = RunResult(returncode=rc, log_path=running.log_path, metrics=read_metrics(metrics_path))
    assert rc == PREEMPTED_EXIT, tail(first.log)
    stopped = first.steps()[-1]
    assert first.steps() == list(range(1, stopped + 1)) and 3 <= stopped < 6, first.steps()
    assert "SIGTERM received: the trainer saves after the step in flight" in first.log
    assert f"stopped after step {stopped} (SIGTERM to the driver" in first.log, tail(first.log)
    assert "SIGTERM received again" in first.log
    # the stop's checkpoint is complete, with the in-flight trajectories; retention kept it alone
    assert (ckpt / TRACKER_FILE).read_text().strip() == str(stopped)
    assert incomplete_reasons(ckpt / f"global_step_{stopped}", stopped, CheckpointLayout(async_mode=True)) == []
    assert (ckpt / f"global_step_{stopped}" / "transfer_queue").is_dir()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step_")) == [f"global_step_{stopped}"]

    # the trainer pool (the FSDP rank) on one node, the standalone pool (its vLLM server) on the other
    placed = placement(before)
    assert len(placed["WorkerDict"]) == 1 and len(placed["vLLMHttpServer"]) == 1, placed
    assert placed["WorkerDict"] != placed["vLLMHttpServer"], placed
    assert "cpu_gloo" in first.log

    for m in first.metrics:
        data = m["data"]
        # the estimator saw one slice per call (one group of 4), two calls per step
        assert (data["gtpo/estimator_rows"], data["gtpo/estimator_groups"]) == (4.0, 1.0), data
        assert data["gtpo/estimator_calls_total"] == 2.0
    # the weights reached the standalone replica at every sync (the first before step 1, then one per step): the
    # rollout worker received every byte the trainer's rank 0 sent
    sent = [int(n) for n in re.findall(r"cpu_gloo: sent (\d+) bytes", first.log)]
    received = [int(n) for n in re.findall(r"cpu_gloo: received (\d+) bytes", first.log)]
    assert len(sent) == len(received) >= stopped, (sent, received)
    assert set(sent) == set(received) and len(set(sent)) == 1, (sent, received)
    # the standalone pool generated ahead with the weights of an earlier sync
    assert max(m["data"]["gtpo/trajectory_staleness_max"] for m in first.metrics) >= 1

    resumed = run_recipe(
        ray_cluster, tmp_path, common + ["trainer.resume_mode=auto"], name="resumed", metrics_name="run"
    )
    assert resumed.returncode == 0, tail(resumed.log)
    assert f"resumed from {ckpt / f'global_step_{stopped}'} at step {stopped}" in resumed.log, tail(resumed.log)
    assert [r["step"] for r in read_metrics(metrics_path)] == [1, 2, 3, 4, 5, 6]
    # retention held across the resume: the step-6 save removed step 4, trajectories included
    assert (ckpt / TRACKER_FILE).read_text().strip() == "6"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step_")) == ["global_step_6"]
    assert (ckpt / "global_step_6" / "transfer_queue").is_dir()


@pytest.mark.slow  # the default tier's budget; the watchdog's own tests (tests/test_watchdog.py) stay in it
def test_a_wedged_standalone_replica_fails_the_sync_within_its_limit_naming_the_stage(
    ray_cluster, tiny_assets, tmp_path
):
    """After step 1 the standalone pool's weight receiver is stopped (SIGSTOP: a wedged replica, as a GPU fault or
    a hung NCCL call leaves it): the next sync waits on it, and the watchdog ends the run within its limit."""
    limit = 30
    overrides = base_overrides(tiny_assets) + [
        *SEPARATE,
        "trainer.total_training_steps=20",
        f"algorithm.watchdog.weight_sync_s={limit}",
        "algorithm.watchdog.grace_s=30",
    ]
    run = RunningRecipe(ray_cluster, tmp_path, overrides, name="wedged", log_env=None)
    run.wait_until(lambda: len(read_metrics(run.metrics_path)) >= 1, timeout=600)
    receivers = process_ids("ray::CheckpointEngineWorker")
    assert len(receivers) == 1, receivers
    (receiver,) = receivers
    os.kill(receiver, signal.SIGSTOP)
    start = time.monotonic()
    try:
        run.proc.wait(timeout=limit + 240)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the watchdog's stop usually killed it already
            os.kill(receiver, signal.SIGKILL)  # a stopped process takes no other signal
        if run.proc.poll() is None:
            run.kill_job()
    elapsed = time.monotonic() - start
    log = run.log
    assert run.proc.returncode != 0, tail(log)
    stage = r"gtpo watchdog: stage 'weight sync \(standalone update_weights\)' made no progress for \d+ s"
    assert re.search(stage, log), tail(log)
    assert "StageTimeoutError" in log and f"algorithm.watchdog.weight_sync_s={limit}" in log
    # the standalone pool was stopped too, not only the trainer's workers
    # (the FSDP rank, the standalone vLLM server and its weight receiver)
    assert "gtpo watchdog: stopped 3 worker actors" in log, tail(log)
    assert elapsed < limit + 120, f"the wedged run took {elapsed:.0f} s to end"
    # it trained until the replica stopped, then never again
    assert len(read_metrics(run.metrics_path)) <= 2
