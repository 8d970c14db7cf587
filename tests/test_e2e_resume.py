"""Hard kills and a resume through verl 0.9.1's real trainer on CPU: nothing of the run is lost.

    .venv/bin/python -m pytest -q -m e2e tests/test_e2e_resume.py

``gtpo_traj`` (paper variant: the ini gate measures ``<H>_ini`` on the first batch) at world size two on the session
cluster's two simulated nodes, with a checkpoint every 2 steps (two shards each), the file logger and TensorBoard.
One FSDP rank gets ``kill -9`` while step 6 runs, after the step-4 checkpoint: the run ends by itself within
``RANK_DEATH_BOUND_S``, naming the dead worker. Then the state a kill during the step-6 *save* leaves: a
``global_step_6`` whose actor shard and ``data.pt`` are cut short, no recipe state file, and the tracker emptied
(verl writes it in place, a kill between its ``open`` and ``write``). Then ``trainer.resume_mode=auto``: the resumed
run starts from step 4, the newest complete checkpoint, with nothing of the half-written folder, and every tracker
holds each step once. The slow tier kills one vLLM engine instead (tests/test_e2e_worker_death.py).
The metric log is at verl's default path (``VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``), the other path
source, ``VERL_FILE_LOGGER_PATH``, is tests/test_e2e_trainer.py's resume test.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import time

import pytest
import torch

from gtpo.metric_log import read_file_log
from gtpo.trainer.resume.checkpoints import TRACKER_FILE
from tests.support.e2e import (
    WORLD_SIZE_2,
    RunningRecipe,
    base_overrides,
    process_ids,
    read_metrics,
    run_recipe,
    shard_names,
    tail,
)

# slow tier: the default tier keeps a resume after a stop under a real Slurm's requeue (tests/test_slurm_preemption.py)
# and after SIGTERM under separate_async (tests/test_e2e_separate_async.py), and stays within its 25 minutes
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

H_INI = "gtpo_traj/h_ini"
# How long the run may take to end after one FSDP rank died (it ends within seconds: verl's next call on the rank
# raises; the bound leaves room for a loaded 2-core machine).
RANK_DEATH_BOUND_S = 120


def _prompts(dump_file) -> list[str]:
    """Sorted prompt texts of one step's rollout dump (verl's ``<step>.jsonl``; ``rollout.n`` rows per prompt)."""
    return sorted({json.loads(line)["input"] for line in dump_file.read_text().splitlines() if line.strip()})


def _dump_complete(dump_file, like) -> bool:
    """verl writes the dump in a background thread: complete once it has as many lines as an earlier step's."""
    if not (dump_file.exists() and like.exists()):
        return False
    return len(dump_file.read_text().splitlines()) == len(like.read_text().splitlines())


def _tensorboard(tb_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()  # TensorBoard's own reader: honours the resumed writer's purge_step
    return acc


def test_kill_9_during_step_6_then_a_kill_during_its_save_then_resume_keeps_everything(
    ray_cluster, tiny_assets, tmp_path
):
    from PIL import Image

    from gtpo.viz.tracker import IMAGE_TAG

    ckpt = tmp_path / "ckpt"
    dumps = tmp_path / "rollouts"
    log_root = tmp_path / "logs"
    tb_dir = tmp_path / "tb"
    metrics = log_root / "resume" / "kill9.jsonl"  # verl's default file-logger path
    overrides = base_overrides(tiny_assets) + [
        *WORLD_SIZE_2,
        "method=gtpo_traj",
        "data.seed=7",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
        "trainer.total_training_steps=6",
        f"trainer.rollout_data_dir={dumps}",
        "trainer.project_name=resume",
        "trainer.experiment_name=kill9",
        "trainer.logger=[console,file,tensorboard]",
    ]
    # The TaskRunner is a Ray actor: the log folders travel in the runtime env.
    log_env = {"VERL_FILE_LOGGER_ROOT": str(log_root), "TENSORBOARD_DIR": str(tb_dir)}

    first = RunningRecipe(ray_cluster, tmp_path, overrides, name="first", log_env=log_env)
    steps_logged = lambda: [r["step"] for r in read_metrics(metrics)]  # noqa: E731
    first.wait_until(lambda: 5 in steps_logged() and _dump_complete(dumps / "5.jsonl", dumps / "1.jsonl"), timeout=900)
    # One FSDP rank dies (kill -9) in step 6: the run ends by itself within seconds, naming the dead worker (verl's
    # next call on it raises ActorDiedError), and never hangs; then whatever is left of the job goes too.
    ranks = sorted(set(process_ids("ray::WorkerDict")) & first.job_pids())
    assert len(ranks) == 2, f"two FSDP ranks expected, found {ranks}:\n{tail(first.log)}"
    killed_at = time.monotonic()
    os.kill(ranks[-1], signal.SIGKILL)
    first.proc.wait(timeout=RANK_DEATH_BOUND_S)
    ended_after = time.monotonic() - killed_at
    assert first.proc.returncode != 0 and ended_after < RANK_DEATH_BOUND_S, (first.proc.returncode, ended_after)
    assert "ActorDiedError" in first.log and f"pid: {ranks[-1]}" in first.log, tail(first.log)
    assert "WorkerDict" in first.log.split("ActorDiedError", 1)[1]
    first.kill_job()
    tracker = (ckpt / TRACKER_FILE).read_text().strip()
    assert tracker == "4", f"the kill came after the step-6 checkpoint (tracker={tracker}); step 6 ran too fast"
    # every rank's shard of model, optimiser and extra state, for world size two
    two_ranks = sorted(f"{kind}_world_size_2_rank_{r}.pt" for kind in ("model", "optim", "extra_state") for r in (0, 1))
    assert shard_names(ckpt / "global_step_4" / "actor") == two_ranks
    before = read_metrics(metrics)
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]
    h_ini_before = {r["data"][H_INI] for r in before}
    assert len(h_ini_before) == 1, h_ini_before  # measured once at step 1, then logged unchanged
    assert {"gtpo_traj/conflict_token_frac", "gtpo_traj/filtered_traj_frac", H_INI} <= {
        k for r in before for k in r["data"] if k.startswith("gtpo_traj/")
    }
    tb_before = _tensorboard(tb_dir)
    assert [e.step for e in tb_before.Scalars("critic/score/mean")][:4] == [1, 2, 3, 4]
    prompts_step5 = _prompts(dumps / "5.jsonl")  # what the uninterrupted run drew at step 5
    prompts_step1 = _prompts(dumps / "1.jsonl")
    assert prompts_step5 != prompts_step1  # so a dataloader restarted from scratch would be caught
    shutil.copy(dumps / "5.jsonl", tmp_path / "first_5.jsonl")

    # What a kill during the step-6 save leaves (verl writes actor/, data.pt, the tracker in place, then the recipe
    # its state file): shards cut short, which would fail to load if anything read them, no state file, an empty
    # tracker.
    half = ckpt / "global_step_6"
    shutil.copytree(ckpt / "global_step_4" / "actor", half / "actor")
    for shard in (half / "actor").glob("*.pt"):
        shard.write_bytes(shard.read_bytes()[:100])
    (half / "data.pt").write_bytes(b"\x80\x02truncated")
    assert not (half / "gtpo_state.json").exists()
    (ckpt / TRACKER_FILE).write_text("")

    resumed = run_recipe(
        ray_cluster, tmp_path, overrides + ["trainer.resume_mode=auto"], name="resumed", log_env=log_env
    )
    assert resumed.returncode == 0, f"resumed run failed (rc={resumed.returncode}):\n{tail(resumed.log)}"
    assert f"resumed from {ckpt / 'global_step_4'} at step 4" in resumed.log, tail(resumed.log)
    assert f"{ckpt / TRACKER_FILE} is empty: resuming from {ckpt / 'global_step_4'}" in resumed.log

    raw = read_metrics(metrics)
    # One record per step: the history up to the checkpoint kept as it was, the killed run's step 5 gone.
    assert [r["step"] for r in raw] == [1, 2, 3, 4, 5, 6]
    assert raw[:4] == before[:4]
    assert raw[4]["data"] != before[4]["data"]  # the resumed run's step 5 (its timings differ, at least)
    assert read_file_log(metrics) == [(r["step"], r["data"]) for r in raw]
    from gtpo.viz.curves import load_metrics

    assert load_metrics(metrics)[H_INI][0] == [1, 2, 3, 4, 5, 6]
    # TensorBoard: one value per step; steps 1-4 the first run's, 5 and 6 the resumed run's.
    tb = _tensorboard(tb_dir)
    score = {e.step: e.value for e in tb.Scalars("critic/score/mean")}
    assert [e.step for e in tb.Scalars("critic/score/mean")] == [1, 2, 3, 4, 5, 6]
    for r in raw:
        assert score[r["step"]] == pytest.approx(r["data"]["critic/score/mean"])
    # The token heatmap of every step, once, as a PNG at the step it belongs to.
    images = tb.Images(IMAGE_TAG)
    assert [e.step for e in images] == [1, 2, 3, 4, 5, 6]
    for e in images:
        img = Image.open(io.BytesIO(e.encoded_image_string))
        assert img.format == "PNG" and img.size == (e.width, e.height) and min(img.size) > 100
        assert (dumps / "heatmaps" / f"tokens_{e.step}.advantage.html").is_file()

    # <H>_ini after the resume is the value measured before it (not re-measured).
    assert {r["data"][H_INI] for r in raw[4:]} == h_ini_before
    # The resumed step 5 drew the prompts the uninterrupted run drew at step 5 (dataloader state of step 4).
    assert _prompts(dumps / "5.jsonl") == prompts_step5
    # The resumed run saved step 6 over the half-written folder: whole shards, a state file, the tracker.
    assert (ckpt / TRACKER_FILE).read_text().strip() == "6"
    assert json.loads((half / "gtpo_state.json").read_text())["gtpo_traj"]["h_ini"] in h_ini_before
    assert shard_names(half / "actor") == two_ranks
    assert all(shard.stat().st_size > 1000 for shard in (half / "actor").glob("*.pt"))
    torch.load(half / "data.pt", weights_only=False)
