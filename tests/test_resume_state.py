"""Resume keeps everything: the trackers' history (verl's real ``Tracking``) and the recipe's checkpoint state.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_resume_state.py

Which checkpoint a resume starts from is tests/test_resume_checkpoint.py; the hard-kill run through the real trainer
is tests/test_e2e_resume.py.
"""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from gtpo.methods import METHODS
from gtpo.metric_log import read_file_log
from gtpo.trainer.observe import metric_history
from gtpo.trainer.resume import checkpoint_state
from gtpo.verl_plugin.estimators import VerlEstimator

# gtpo_traj's estimator in verl's calling convention, as verl's registry hands it to the trainer
compute_gtpo_traj_advantage = VerlEstimator(METHODS["gtpo_traj"])


def _tracking(project="proj", experiment="exp", backends=("file",)):
    from verl.utils.tracking import Tracking

    return Tracking(project_name=project, experiment_name=experiment, default_backend=list(backends))


def _log_steps(tracking, steps, tag):
    for step in steps:
        tracking.log(data={"critic/score/mean": float(step), "run": tag}, step=step)


def _raw_steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _resumed(path, step, backends=("file",)):
    """A resumed run's Tracking at ``step``, as the trainer builds it: history first, then verl's Tracking."""
    history = metric_history.MetricHistory(step, str(path) if "file" in backends else None)
    tracking = _tracking(backends=backends)
    history.attach(tracking)
    return tracking


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


def test_resume_keeps_steps_up_to_the_checkpoint_once_each(log_path):
    first = _tracking()
    _log_steps(first, [1, 2, 3, 4, 5], "first")  # killed during step 6, last checkpoint at step 4
    first.finish()
    before = log_path.read_text().splitlines()
    resumed = _resumed(log_path, 4)
    assert _raw_steps(log_path) == [1, 2, 3, 4]  # the killed run's step 5 is gone before anything is logged
    assert log_path.read_text().splitlines() == before[:4]  # the kept lines, byte for byte
    resumed.log(data={"val-core/x/acc/mean@1": 0.5}, step=4)  # validation before training, at the resumed step
    _log_steps(resumed, [5, 6], "resumed")
    resumed.finish()

    assert _raw_steps(log_path) == [1, 2, 3, 4, 5, 6]
    by_step = dict(read_file_log(log_path))
    assert by_step[4] == {"critic/score/mean": 4.0, "run": "first", "val-core/x/acc/mean@1": 0.5}
    assert by_step[5]["run"] == by_step[6]["run"] == "resumed"
    assert not (log_path.parent / (log_path.name + metric_history.ASIDE_SUFFIX)).exists()

    from gtpo.cpu.demo import file_logger_records, load_rewards
    from gtpo.viz.curves import load_metrics

    assert load_metrics(log_path)["critic/score/mean"] == ([1, 2, 3, 4, 5, 6], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert [rec["step"] for rec, _ in file_logger_records(log_path)] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in load_rewards(log_path, key="critic/score/mean")] == [1, 2, 3, 4, 5, 6]


def test_a_resumed_step_without_its_record_gets_the_validation_alone(log_path):
    """A kill after the step-4 checkpoint and before step 4 was logged (verl saves, validates, then logs)."""
    first = _tracking()
    _log_steps(first, [1, 2, 3], "first")
    first.finish()
    resumed = _resumed(log_path, 4)
    resumed.log(data={"val-core/x/acc/mean@1": 0.25}, step=4)
    resumed.log(data={"val-core/x/acc/mean@1": 0.5}, step=4)  # logged twice at the resumed step: merged
    _log_steps(resumed, [5], "resumed")
    resumed.finish()
    assert _raw_steps(log_path) == [1, 2, 3, 4, 5]
    assert dict(read_file_log(log_path))[4] == {"val-core/x/acc/mean@1": 0.5}


def test_an_older_log_with_repeated_steps_is_rewritten_one_line_per_step(log_path):
    log_path.write_text(
        "".join(json.dumps({"step": s, "data": {"v": s, "run": r}}) + "\n" for s, r in
                [(1, "a"), (2, "a"), (3, "a"), (2, "b"), (3, "b"), (4, "b"), (5, "b")])
        + '{"step": 6, "data": {"v"'  # killed in the middle of a write
    )  # fmt: skip
    resumed = _resumed(log_path, 4)
    resumed.finish()
    assert _raw_steps(log_path) == [1, 2, 3, 4]
    assert [d["run"] for _, d in read_file_log(log_path)] == ["a", "b", "b", "b"]


def test_a_log_out_of_step_order_keeps_the_steps_up_to_the_checkpoint_once_each(log_path):
    """Lines in file order 1, 3, 2, 5, 4, 3 (two writers on one path, or logs joined by hand): after a resume at 3
    the log holds steps 1, 2, 3 in order, the twice-logged step 3 merged (the later value wins), then the new steps."""
    records = [(1, "a"), (3, "a"), (2, "a"), (5, "a"), (4, "a"), (3, "b")]
    log_path.write_text("".join(json.dumps({"step": s, "data": {"v": s, "run": r}}) + "\n" for s, r in records))
    lines = log_path.read_text().splitlines()
    resumed = _resumed(log_path, 3)
    _log_steps(resumed, [4], "resumed")
    resumed.finish()
    assert _raw_steps(log_path) == [1, 2, 3, 4]
    assert log_path.read_text().splitlines()[:2] == [lines[0], lines[2]]  # a step logged once: its line, as it was
    assert read_file_log(log_path)[2:] == [
        (3, {"v": 3, "run": "b"}),
        (4, {"critic/score/mean": 4.0, "run": "resumed"}),
    ]


def test_a_fresh_run_leaves_no_aside_copy_of_an_old_log(log_path):
    """A resume killed before attach leaves the old run's log aside; the next start is a fresh run
    (``resume_mode=disable``). The aside copy must go, or this run's first resume would take it for its history."""
    old = _tracking()
    _log_steps(old, [1, 2, 3], "old")
    old.finish()
    aside = log_path.parent / (log_path.name + metric_history.ASIDE_SUFFIX)
    metric_history.MetricHistory(2, str(log_path))
    assert aside.exists()

    history = metric_history.MetricHistory(0, str(log_path))
    fresh = _tracking()
    history.attach(fresh)
    _log_steps(fresh, [1, 2, 3], "fresh")
    fresh.finish()
    assert not aside.exists()
    assert [d["run"] for _, d in read_file_log(log_path)] == ["fresh", "fresh", "fresh"]

    _resumed(log_path, 2).finish()  # this run's own first resume
    assert [d["run"] for _, d in read_file_log(log_path)] == ["fresh", "fresh"]
    assert not aside.exists()


def test_kill_between_set_aside_and_attach_keeps_the_history(log_path):
    first = _tracking()
    _log_steps(first, [1, 2], "first")
    first.finish()
    with open(log_path, "ab") as f:
        f.write(b'{"step": 3, "da')  # killed in the middle of a write
    metric_history.MetricHistory(2, str(log_path))  # moves the log aside ...
    _tracking().finish()  # ... verl truncates the path, then the job is killed before attach
    aside = log_path.parent / (log_path.name + metric_history.ASIDE_SUFFIX)
    assert log_path.read_text() == "" and aside.exists()
    # a kill in the middle of the rewrite leaves a temporary file beside the log: ignored
    (log_path.parent / (log_path.name + ".tmp.1")).write_text('{"step": 1, "data": {}}\n')

    resumed = _resumed(log_path, 2)  # the aside copy is the history: kept, not replaced by the empty file
    _log_steps(resumed, [3], "resumed")
    resumed.finish()
    assert _raw_steps(log_path) == [1, 2, 3]  # the partial line is gone, nothing else
    assert not aside.exists()


def test_tensorboard_after_a_resume_holds_one_value_per_step(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    first = _tracking(backends=["tensorboard"])
    for step in [1, 2, 3, 4, 5]:
        first.log(data={"critic/score/mean": float(step)}, step=step)
    first.logger["tensorboard"].writer.flush()  # what the killed run had written

    resumed = _resumed(None, 4, backends=["tensorboard"])
    resumed.log(data={"critic/score/mean": 50.0}, step=5)
    resumed.log(data={"critic/score/mean": 60.0}, step=6)
    resumed.finish()
    first.finish()
    scalars = EventAccumulator(str(tmp_path / "tb"))
    scalars.Reload()
    events = scalars.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0), (6, 60.0)]


def test_a_validation_only_run_of_an_older_checkpoint_keeps_the_whole_history(log_path, tmp_path, monkeypatch):
    """``scripts/eval_checkpoint.sh`` (``val_only``, ``resume_path``) on the step-2 checkpoint of a run that went on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    first = _tracking(backends=("file", "tensorboard"))
    for step in [1, 2, 3, 4]:
        first.log(data={"critic/score/mean": float(step)}, step=step)
    first.finish()
    config = OmegaConf.create(
        {"logger": ["file", "tensorboard"], "project_name": "proj", "experiment_name": "exp", "val_only": True}
    )
    history = metric_history.MetricHistory.for_trainer(config, resumed_step=2)
    evaluation = _tracking(backends=("file", "tensorboard"))
    history.attach(evaluation)
    evaluation.log(data={"val-core/x/acc/mean@32": 0.5}, step=2)
    evaluation.finish()
    assert _raw_steps(log_path) == [1, 2, 3, 4, 2]
    scalars = EventAccumulator(str(tmp_path / "tb"))
    scalars.Reload()
    assert [e.step for e in scalars.Scalars("critic/score/mean")] == [1, 2, 3, 4]


def test_default_path_from_verl_root(tmp_path, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    tracking = _tracking("my_project", "run_7")
    assert metric_history.file_logger_path("my_project", "run_7") == tracking.logger["file"].filepath
    tracking.finish()
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT")
    monkeypatch.chdir(tmp_path)
    tracking = _tracking("p", "e")
    assert metric_history.file_logger_path("p", "e") == str(tmp_path / "p" / "e.jsonl")
    tracking.finish()


@pytest.mark.parametrize("first_hook", ["on_validate_begin", "on_train_begin"])
def test_trainer_hooks_attach_the_history(log_path, first_hook):
    """verl's fit() builds its Tracking as ``self.logger``, then calls ``on_validate_begin`` (validation before
    training) or ``on_train_begin`` before logging: the first of them applies the history, once."""
    from gtpo.trainer.modes import GTPOTrainerSync

    first = _tracking()
    _log_steps(first, [1, 2, 3], "first")
    first.finish()
    trainer = object.__new__(GTPOTrainerSync)
    config = OmegaConf.create({"logger": ["console", "file"], "project_name": "proj", "experiment_name": "exp"})
    trainer._metric_history = metric_history.MetricHistory.for_trainer(config, resumed_step=2)
    trainer.logger = _tracking()
    assert _raw_steps(log_path) == []  # verl's FileLogger truncated the log; the history is aside
    getattr(trainer, first_hook)()
    assert _raw_steps(log_path) == [1, 2]
    trainer.on_train_begin()  # the second hook finds nothing left to apply
    trainer.logger.log(data={"critic/score/mean": 3.5}, step=3)
    trainer.logger.finish()
    assert _raw_steps(log_path) == [1, 2, 3]
    assert dict(read_file_log(log_path))[3] == {"critic/score/mean": 3.5}


def test_strict_and_lenient_reading(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "data": {"a": 1}}\n{"step": "x"}\n{"step": 2, "data": {"a": 2}}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: step='x' is not an integer"):
        read_file_log(p)
    assert read_file_log(p, strict=False) == [(1, {"a": 1}), (2, {"a": 2})]
    with pytest.raises(ValueError, match="not found"):
        read_file_log(tmp_path / "missing.jsonl")


# ------------------------------------------------------------------------------------------- checkpoint state


def test_state_round_trip_restores_h_ini(tmp_path):
    state = checkpoint_state.new_state()
    state["gtpo_traj"]["h_ini"] = 0.4375
    path = checkpoint_state.save_state(str(tmp_path / "global_step_4"), 4, state)
    assert json.loads(open(path).read()) == {"format": 1, "global_steps": 4, "gtpo_traj": {"h_ini": 0.4375}}
    resumed = checkpoint_state.new_state()  # a new trainer
    algorithm = OmegaConf.create({"gtpo_traj": {"h_ini": None}})
    restored = checkpoint_state.restore_state(str(tmp_path / "global_step_4"), algorithm, resumed)
    assert restored == {"gtpo_traj.h_ini": 0.4375}
    assert resumed == {"gtpo_traj": {"h_ini": 0.4375}}


def test_explicit_h_ini_wins_and_missing_state_restores_nothing(tmp_path):
    saved = {"gtpo_traj": {"h_ini": 0.4}}
    checkpoint_state.save_state(str(tmp_path / "global_step_2"), 2, saved)
    resumed = checkpoint_state.new_state()
    explicit = OmegaConf.create({"gtpo_traj": {"h_ini": 1.5}})
    assert checkpoint_state.restore_state(str(tmp_path / "global_step_2"), explicit, resumed) == {}
    assert resumed == checkpoint_state.new_state() == {"gtpo_traj": {}}  # nothing measured, nothing restored
    assert checkpoint_state.restore_state(str(tmp_path / "no_such_step"), explicit, resumed) == {}
    (tmp_path / "global_step_2" / checkpoint_state.STATE_FILE).write_text('{"format": 99}')
    with pytest.raises(ValueError, match="format=99"):
        checkpoint_state.restore_state(str(tmp_path / "global_step_2"), explicit, resumed)


def _traj_kwargs(entropy: float, global_steps: int) -> dict:
    import numpy as np
    import torch

    return dict(
        token_level_rewards=torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
        response_mask=torch.ones(2, 3, dtype=torch.long),
        index=np.array(["u", "u"], dtype=object),
        config=OmegaConf.create({"gtpo_traj": {"variant": "paper"}}),
        entropy=torch.full((2, 3), entropy),
        responses=torch.tensor([[1, 2, 3], [1, 2, 4]]),
        global_steps=global_steps,
    )


def test_restored_h_ini_feeds_the_estimator_on_a_resumed_step(tmp_path):
    """Without the restore, step 5 of a resumed run raises; with it, the gate uses the saved value."""
    kwargs = _traj_kwargs(entropy=2.0, global_steps=5)
    resumed = checkpoint_state.new_state()
    with pytest.raises(ValueError, match="gtpo_state.json"):
        compute_gtpo_traj_advantage(**kwargs, state=resumed["gtpo_traj"])
    checkpoint_state.save_state(str(tmp_path / "global_step_4"), 4, {"gtpo_traj": {"h_ini": 0.25}})
    checkpoint_state.restore_state(str(tmp_path / "global_step_4"), kwargs["config"], resumed)
    metrics: dict = {}
    compute_gtpo_traj_advantage(**kwargs, metrics=metrics, state=resumed["gtpo_traj"])
    assert metrics["gtpo_traj/h_ini"] == 0.25
    assert metrics["gtpo_traj/filter_on"] == 1.0  # 0.25 <= ln 2: filtering on, every completion (H = 2) dropped
    assert metrics["gtpo_traj/filtered_traj_frac"] == 1.0


def test_two_trainers_in_one_process_keep_their_own_h_ini(tmp_path):
    """Each trainer measures ``<H>_ini`` into its own state, saves and restores its own: nothing is shared."""
    import gtpo.verl_plugin.register  # noqa: F401  (the estimator verl's registry hands the trainer)
    from gtpo.trainer.modes import GTPOTrainerSync

    first, second = (GTPOTrainerSync.__new__(GTPOTrainerSync) for _ in range(2))
    assert first.recipe_state is first.recipe_state and first.recipe_state is not second.recipe_state
    compute_gtpo_traj_advantage(**_traj_kwargs(0.5, 1), state=first.recipe_state.get("gtpo_traj"))
    assert first.recipe_state == {"gtpo_traj": {"h_ini": 0.5}}
    assert second.recipe_state == {"gtpo_traj": {}}  # nothing measured yet
    compute_gtpo_traj_advantage(**_traj_kwargs(1.25, 1), state=second.recipe_state.get("gtpo_traj"))
    assert (first.recipe_state["gtpo_traj"]["h_ini"], second.recipe_state["gtpo_traj"]["h_ini"]) == (0.5, 1.25)
    # what each one's checkpoint callback writes is its own value
    for name, trainer in (("a", first), ("b", second)):
        callback = checkpoint_state.StateAfterSave(_NoCallback(), trainer.recipe_state)
        callback.on_save(trainer=trainer, global_step=3, checkpoint_dir=str(tmp_path / name / "global_step_3"))
    assert checkpoint_state.read_state(str(tmp_path / "a" / "global_step_3"))["gtpo_traj"] == {"h_ini": 0.5}
    assert checkpoint_state.read_state(str(tmp_path / "b" / "global_step_3"))["gtpo_traj"] == {"h_ini": 1.25}


class _NoCallback:
    def on_save(self, **kwargs) -> None:
        pass
