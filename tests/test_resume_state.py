"""Resume keeps everything: the file logger's history (verl's real ``Tracking``) and the recipe's checkpoint state.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_resume_state.py

The hard-kill run through the real trainer is tests/test_e2e_resume.py.
"""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from gtpo.verl_plugin import checkpoint_state, file_log
from gtpo.verl_plugin import trajectory as traj_adapter


def _tracking(project="proj", experiment="exp"):
    from verl.utils.tracking import Tracking

    return Tracking(project_name=project, experiment_name=experiment, default_backend=["file"])


def _log_steps(tracking, steps, tag):
    for step in steps:
        tracking.log(data={"critic/score/mean": float(step), "run": tag}, step=step)


def _raw_steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture
def log_path(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    return path


def test_verl_file_logger_truncates_without_the_history(log_path):
    """The behaviour kept at bay: a second Tracking on the same path empties it."""
    first = _tracking()
    _log_steps(first, [1, 2], "a")
    first.finish()
    second = _tracking()
    second.finish()
    assert log_path.read_text() == ""


def test_history_survives_a_resume_and_repeats_count_once(log_path):
    first = _tracking()
    _log_steps(first, [1, 2, 3, 4, 5], "first")  # killed during step 6, last checkpoint at step 4
    first.finish()
    history = file_log.FileLogHistory(file_log.file_logger_path("proj", "exp"))
    history.set_aside()
    resumed = _tracking()
    history.reattach(resumed)
    resumed.log(data={"val-core/x/acc/mean@1": 0.5}, step=4)  # validation before training, at the resumed step
    _log_steps(resumed, [5, 6], "resumed")
    resumed.finish()

    assert _raw_steps(log_path) == [1, 2, 3, 4, 5, 4, 5, 6]
    records = file_log.read_file_log(log_path)
    assert [step for step, _ in records] == [1, 2, 3, 4, 5, 6]
    by_step = dict(records)
    assert by_step[5]["run"] == "resumed"  # the later record wins
    assert by_step[4] == {"critic/score/mean": 4.0, "run": "first", "val-core/x/acc/mean@1": 0.5}

    from gtpo.cpu.demo import file_logger_records, load_rewards
    from gtpo.viz.curves import load_metrics

    assert load_metrics(log_path)["critic/score/mean"] == ([1, 2, 3, 4, 5, 6], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert [rec["step"] for rec, _ in file_logger_records(log_path)] == [1, 2, 3, 4, 5, 6]
    assert [data["run"] for _, data in file_logger_records(log_path)][-2:] == ["resumed", "resumed"]
    assert [s for s, _ in load_rewards(log_path, key="critic/score/mean")] == [1, 2, 3, 4, 5, 6]


def test_kill_between_set_aside_and_reattach_keeps_the_history(log_path):
    first = _tracking()
    _log_steps(first, [1, 2], "first")
    first.finish()
    with open(log_path, "ab") as f:
        f.write(b'{"step": 3, "da')  # killed in the middle of a write
    attempt = file_log.FileLogHistory(str(log_path))
    attempt.set_aside()
    _tracking().finish()  # verl truncated the path, then the job was killed before reattach
    assert log_path.read_text() == "" and (log_path.parent / (log_path.name + file_log.ASIDE_SUFFIX)).exists()

    again = file_log.FileLogHistory(str(log_path))
    again.set_aside()  # the aside copy is the history: kept, not replaced by the empty file
    resumed = _tracking()
    again.reattach(resumed)
    _log_steps(resumed, [3], "resumed")
    resumed.finish()
    assert _raw_steps(log_path) == [1, 2, 3]  # the partial line is gone, nothing else
    assert not (log_path.parent / (log_path.name + file_log.ASIDE_SUFFIX)).exists()


def test_default_path_from_verl_root(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    tracking = _tracking("my_project", "run_7")
    assert file_log.file_logger_path("my_project", "run_7") == tracking.logger["file"].filepath
    tracking.finish()
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT")
    monkeypatch.chdir(tmp_path)
    tracking = _tracking("p", "e")
    assert file_log.file_logger_path("p", "e") == str(tmp_path / "p" / "e.jsonl")
    tracking.finish()


def test_trainer_logger_hook_reattaches(log_path):
    """GTPOTrainerSync's ``logger`` setter is where verl's fit() hands over its Tracking."""
    from gtpo.verl_plugin.trainer import GTPOTrainerSync

    first = _tracking()
    _log_steps(first, [1, 2], "first")
    first.finish()
    trainer = object.__new__(GTPOTrainerSync)
    with pytest.raises(AttributeError):
        trainer.logger  # noqa: B018 - unset before fit(), as in verl
    trainer._file_log_history = file_log.FileLogHistory(str(log_path))
    trainer._file_log_history.set_aside()
    trainer.logger = _tracking()
    trainer.logger.log(data={"critic/score/mean": 3.0}, step=3)
    trainer.logger.finish()
    assert _raw_steps(log_path) == [1, 2, 3]


def test_strict_and_lenient_reading(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "data": {"a": 1}}\n{"step": "x"}\n{"step": 2, "data": {"a": 2}}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: step='x' is not an integer"):
        file_log.read_file_log(p)
    assert file_log.read_file_log(p, strict=False) == [(1, {"a": 1}), (2, {"a": 2})]
    with pytest.raises(ValueError, match="not found"):
        file_log.read_file_log(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------------- checkpoint state


@pytest.fixture
def clean_h_ini():
    traj_adapter.reset_h_ini()
    yield
    traj_adapter.reset_h_ini()


def test_state_round_trip_restores_h_ini(tmp_path, clean_h_ini):
    traj_adapter.set_h_ini(0.4375)
    path = checkpoint_state.save_state(str(tmp_path / "global_step_4"), 4)
    assert json.loads(open(path).read()) == {"format": 1, "global_steps": 4, "gtpo_traj": {"h_ini": 0.4375}}
    traj_adapter.reset_h_ini()  # a new process
    algorithm = OmegaConf.create({"gtpo_traj": {"h_ini": None}})
    assert checkpoint_state.restore_state(str(tmp_path / "global_step_4"), algorithm) == {"gtpo_traj.h_ini": 0.4375}
    assert traj_adapter.current_h_ini() == 0.4375


def test_explicit_h_ini_wins_and_missing_state_restores_nothing(tmp_path, clean_h_ini):
    traj_adapter.set_h_ini(0.4)
    checkpoint_state.save_state(str(tmp_path / "global_step_2"), 2)
    traj_adapter.reset_h_ini()
    explicit = OmegaConf.create({"gtpo_traj": {"h_ini": 1.5}})
    assert checkpoint_state.restore_state(str(tmp_path / "global_step_2"), explicit) == {}
    assert traj_adapter.current_h_ini() is None
    assert checkpoint_state.restore_state(str(tmp_path / "no_such_step"), explicit) == {}
    (tmp_path / "global_step_2" / checkpoint_state.STATE_FILE).write_text('{"format": 99}')
    with pytest.raises(ValueError, match="format=99"):
        checkpoint_state.restore_state(str(tmp_path / "global_step_2"), explicit)


def test_restored_h_ini_feeds_the_estimator_on_a_resumed_step(tmp_path, clean_h_ini):
    """Without the restore, step 5 of a resumed run raises; with it, the gate uses the saved value."""
    import numpy as np
    import torch

    mask = torch.ones(2, 3, dtype=torch.long)
    kwargs = dict(
        token_level_rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
        response_mask=mask,
        index=np.array(["u", "u"], dtype=object),
        config=OmegaConf.create({"gtpo_traj": {"variant": "paper"}}),
        entropy=torch.full((2, 3), 2.0),
        responses=torch.tensor([[1, 2, 3], [1, 2, 4]]),
        global_steps=5,
    )
    with pytest.raises(ValueError, match="gtpo_state.json"):
        traj_adapter.compute_gtpo_traj_advantage(**kwargs)
    traj_adapter.set_h_ini(0.25)
    checkpoint_state.save_state(str(tmp_path / "global_step_4"), 4)
    traj_adapter.reset_h_ini()
    checkpoint_state.restore_state(str(tmp_path / "global_step_4"), kwargs["config"])
    metrics: dict = {}
    traj_adapter.compute_gtpo_traj_advantage(**kwargs, metrics=metrics)
    assert metrics["gtpo_traj/h_ini"] == 0.25
    assert metrics["gtpo_traj/filter_on"] == 1.0  # 0.25 <= ln 2: filtering on, every completion (H = 2) dropped
    assert metrics["gtpo_traj/filtered_traj_frac"] == 1.0
