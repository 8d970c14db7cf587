"""A hard kill and a resume through verl 0.9.1's real trainer on CPU: nothing of the run is lost.

    .venv/bin/python -m pytest -q -m e2e tests/test_e2e_resume.py

``gtpo_traj`` (paper variant: the ini gate measures ``<H>_ini`` on the first batch) with a checkpoint every 2 steps;
the whole job (driver and every Ray worker of the job) gets ``kill -9`` while step 6 runs, after the step-4
checkpoint; a newer, half-written ``global_step_6`` folder is left behind; then ``trainer.resume_mode=auto``.
The metric log is at verl's default path (``VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``), the other path
source, ``VERL_FILE_LOGGER_PATH``, is tests/test_e2e_trainer.py's resume test.
"""

from __future__ import annotations

import json
import shutil

import pytest

from gtpo.verl_plugin.file_log import read_file_log
from tests.e2e_support import RunningRecipe, read_metrics, run_recipe, tail
from tests.test_e2e_trainer import base_overrides

pytestmark = pytest.mark.e2e

H_INI = "gtpo_traj/h_ini"


@pytest.fixture(scope="session")
def tiny_assets():
    from gtpo.cpu.tiny_assets import build_tiny_assets

    return build_tiny_assets()


def _prompts(dump_file) -> list[str]:
    """Sorted prompt texts of one step's rollout dump (verl's ``<step>.jsonl``; ``rollout.n`` rows per prompt)."""
    return sorted({json.loads(line)["input"] for line in dump_file.read_text().splitlines() if line.strip()})


def _dump_complete(dump_file, like) -> bool:
    """verl writes the dump in a background thread: complete once it has as many lines as an earlier step's."""
    if not (dump_file.exists() and like.exists()):
        return False
    return len(dump_file.read_text().splitlines()) == len(like.read_text().splitlines())


def test_kill_9_during_step_6_then_resume_keeps_everything(ray_cluster, tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    dumps = tmp_path / "rollouts"
    log_root = tmp_path / "logs"
    metrics = log_root / "resume" / "kill9.jsonl"  # verl's default file-logger path
    overrides = base_overrides(tiny_assets) + [
        "method=gtpo_traj",
        "data.seed=7",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
        "trainer.total_training_steps=6",
        f"trainer.rollout_data_dir={dumps}",
        "trainer.project_name=resume",
        "trainer.experiment_name=kill9",
    ]
    log_env = {"VERL_FILE_LOGGER_ROOT": str(log_root)}

    first = RunningRecipe(ray_cluster, tmp_path, overrides, name="first", log_env=log_env)
    steps_logged = lambda: [r["step"] for r in read_metrics(metrics)]  # noqa: E731
    first.wait_until(lambda: 5 in steps_logged() and _dump_complete(dumps / "5.jsonl", dumps / "1.jsonl"), timeout=600)
    killed = first.kill_job()
    assert killed, f"no Ray worker pid found in the driver's log:\n{tail(first.log)}"
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == "4", f"the kill came after the step-6 checkpoint (tracker={tracker}); step 6 ran too fast"
    before = read_metrics(metrics)
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5]
    h_ini_before = {r["data"][H_INI] for r in before}
    assert len(h_ini_before) == 1, h_ini_before  # measured once at step 1, then logged unchanged
    prompts_step5 = _prompts(dumps / "5.jsonl")  # what the uninterrupted run drew at step 5
    prompts_step1 = _prompts(dumps / "1.jsonl")
    assert prompts_step5 != prompts_step1  # so a dataloader restarted from scratch would be caught
    shutil.copy(dumps / "5.jsonl", tmp_path / "first_5.jsonl")

    # A newer checkpoint folder half-written by the kill (or completed by hand to look like one): the actor
    # shard cut short, no data.pt, a recipe state that would show if it were read.
    half = ckpt / "global_step_6"
    (half / "actor").mkdir(parents=True, exist_ok=True)
    (half / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"\x80\x02truncated")
    (half / "gtpo_state.json").write_text(json.dumps({"format": 1, "global_steps": 6, "gtpo_traj": {"h_ini": 99.0}}))

    resumed = run_recipe(
        ray_cluster, tmp_path, overrides + ["trainer.resume_mode=auto"], name="resumed", log_env=log_env
    )
    assert resumed.returncode == 0, f"resumed run failed (rc={resumed.returncode}):\n{tail(resumed.log)}"
    assert f"resumed from {ckpt / 'global_step_4'} at step 4" in resumed.log, tail(resumed.log)

    raw = read_metrics(metrics)
    # The history before the kill is kept; training continued from step 5 (step 5 is logged again).
    assert [r["step"] for r in raw] == [1, 2, 3, 4, 5, 5, 6]
    assert raw[:5] == before
    # What the readers see: every step 1..6 exactly once, the resumed run's step 5.
    merged = read_file_log(metrics)
    assert [step for step, _ in merged] == [1, 2, 3, 4, 5, 6]
    assert dict(merged)[5] == raw[5]["data"]
    from gtpo.viz.curves import load_metrics

    assert load_metrics(metrics)[H_INI][0] == [1, 2, 3, 4, 5, 6]
    # <H>_ini after the resume is the value measured before it (not re-measured, not the half-written 99).
    assert {r["data"][H_INI] for r in raw[5:]} == h_ini_before
    # The resumed step 5 drew the prompts the uninterrupted run drew at step 5 (dataloader state of step 4).
    assert _prompts(dumps / "5.jsonl") == prompts_step5
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert json.loads((ckpt / "global_step_6" / "gtpo_state.json").read_text())["gtpo_traj"]["h_ini"] in h_ini_before
