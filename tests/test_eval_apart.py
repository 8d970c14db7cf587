"""An evaluation beside a live run (scripts/eval_checkpoint.sh while the run it evaluates still trains): the evaluation
runs under a name and in folders of its own, so the run's metric log, checkpoints and folder are left alone.

    .venv/bin/python -m pytest -q -n 0 tests/test_eval_apart.py

The evaluation's launch goes through the real launcher up to the driver's command line (a stand-in interpreter records
it); its trackers are then built as its trainer builds them (gtpo's MetricHistory, then verl's FileLogger), between
steps that the live run's own FileLogger logs. The order is the test's, not the machine's: no timing decides anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gtpo.launch.checks import check_evaluation_apart
from gtpo.launch.runs import Run, write_record
from gtpo.trainer.observe.metric_history import MetricHistory
from tests.support.checkpoints import complete_checkpoint
from tests.support.e2e import REPO_ROOT
from tests.support.launch import REAL_LAUNCHER, dry_run_env

EVALUATE = REPO_ROOT / "scripts" / "eval_checkpoint.sh"
LAUNCHER = REPO_ROOT / "scripts" / "run_gtpo_qwen2.5_7b.sh"
PROJECT, RUN_NAME = "gtpo-reproduction", "gtpo-qwen2.5-7b"
# What the stand-in interpreter records of the driver's environment.
RECORDED_ENV = ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_DIR", "DRY_RUN")


class _Tracking:
    """verl's ``Tracking`` as MetricHistory sees it: a dict of backends."""

    def __init__(self, backends: dict):
        self.logger = backends


def _tree_hashes(directory: Path, skip: str = "") -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and not (skip and p.is_relative_to(skip))}  # fmt: skip


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _run_folder(tmp_path: Path) -> Path:
    """The 7B launcher's run folder under ``RAY_DATA_HOME=tmp_path/data``, its record and a complete step 2."""
    run_dir = tmp_path / "data" / "ckpts" / PROJECT / RUN_NAME
    complete_checkpoint(run_dir / "global_step_2", 2)
    write_record(str(run_dir), Run("gtpo", "qwen2.5_7b", None, (), False).identity(RUN_NAME))
    return run_dir


def _stand_in_python(tmp_path: Path) -> tuple[Path, Path]:
    """An interpreter that runs the launcher for real and records every other call: its arguments, one per line,
    then the driver's environment (:data:`RECORDED_ENV`)."""
    record = tmp_path / "calls"
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir(exist_ok=True)
    dump_env = "".join(f'echo "env {name}=${{{name}:-}}" >> "{record}"\n' for name in RECORDED_ENV)
    fake.write_text(
        "#!/usr/bin/env bash\n"
        + REAL_LAUNCHER
        + f'echo "call $2" >> "{record}"\nprintf "arg %s\\n" "$@" >> "{record}"\n'
        + dump_env
    )
    fake.chmod(0o755)
    return fake, record


def _evaluate(tmp_path: Path, checkpoint: Path, **extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    fake, record = _stand_in_python(tmp_path)
    env = {k: v for k, v in dry_run_env(tmp_path).items() if k not in ("DRY_RUN", "RAY_ADDRESS")}
    env.update(PYTHON=str(fake), RAY_DATA_HOME=str(tmp_path / "data"), WANDB_MODE="offline", **extra)
    # a training run's own settings in the caller's shell must not reach the evaluation
    env.update(EXP_NAME=RUN_NAME, VERL_FILE_LOGGER_ROOT=str(checkpoint.parent / "logs"))
    proc = subprocess.run(["bash", str(EVALUATE), str(LAUNCHER), str(checkpoint)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    return proc, record


def _driver_call(record: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The driver's overrides (key -> value) and environment, from the stand-in's record."""
    calls = record.read_text().split("call ")[1:]
    driver = next(c for c in calls if c.startswith("recipe.gtpo.main_gtpo"))
    args = [line[4:] for line in driver.splitlines() if line.startswith("arg ")]
    overrides = dict(a.split("=", 1) for a in args if "=" in a)
    env = dict(line[4:].split("=", 1) for line in driver.splitlines() if line.startswith("env "))
    return overrides, env


def test_an_evaluation_beside_a_live_run_leaves_its_log_and_folder_alone(tmp_path, monkeypatch):
    from verl.utils.tracking import FileLogger

    run_dir = _run_folder(tmp_path)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(run_dir / "logs"))
    training = FileLogger(PROJECT, RUN_NAME)  # the live run's logger, open through the whole test
    for step in (1, 2, 3):
        training.log({"training/x": float(step)}, step)
    run_log = run_dir / "logs" / PROJECT / f"{RUN_NAME}.jsonl"
    before = _tree_hashes(run_dir, skip=str(run_log))

    proc, record = _evaluate(tmp_path, run_dir / "global_step_2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    overrides, env = _driver_call(record)
    eval_name, eval_dir = f"{RUN_NAME}-eval-step2", run_dir.parent / f"{RUN_NAME}-eval-step2"
    assert overrides["trainer.experiment_name"] == eval_name and overrides["trainer.project_name"] == PROJECT
    assert overrides["trainer.resume_from_path"] == str(run_dir / "global_step_2")
    assert overrides["trainer.default_local_dir"] == str(eval_dir)
    assert overrides["trainer.validation_data_dir"] == str(eval_dir / "generations")
    assert env == {
        "VERL_FILE_LOGGER_ROOT": str(eval_dir / "logs"),
        "VERL_FILE_LOGGER_PATH": "",
        "TENSORBOARD_DIR": str(eval_dir / "tensorboard"),
        "WANDB_DIR": str(eval_dir),
        "DRY_RUN": "",
    }
    config = OmegaConf.create({"trainer": {
        "val_only": True, "resume_mode": "resume_path", "resume_from_path": overrides["trainer.resume_from_path"],
        "default_local_dir": str(eval_dir), "validation_data_dir": overrides["trainer.validation_data_dir"],
        "logger": ["console", "wandb", "file"], "project_name": PROJECT, "experiment_name": eval_name}})  # fmt: skip
    check_evaluation_apart(config, env)  # the driver's check passes on what the launcher hands it

    # the evaluation's trainer, resumed at step 2 for validation only, between two of the run's steps
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", env["VERL_FILE_LOGGER_ROOT"])
    history = MetricHistory.for_trainer(config.trainer, resumed_step=2)
    evaluation = FileLogger(PROJECT, eval_name)
    history.attach(_Tracking({"file": evaluation}))
    training.log({"training/x": 4.0}, 4)
    evaluation.log({"val-core/aime2024/acc/mean@32": 0.5}, 2)
    evaluation.finish()
    training.log({"training/x": 5.0}, 5)
    training.finish()

    assert _steps(run_log) == [1, 2, 3, 4, 5]
    assert _steps(eval_dir / "logs" / PROJECT / f"{eval_name}.jsonl") == [2]
    assert _tree_hashes(run_dir, skip=str(run_log)) == before
    # the regrading reads the evaluation's dump and writes its tables in the evaluation's folder
    assert f"arg {eval_dir}/generations/2.jsonl\narg --out-dir\narg {eval_dir}\n" in record.read_text()


@pytest.mark.parametrize("where", ["default_local_dir", "validation_data_dir", "file_log", "name"])
def test_an_evaluation_that_would_write_into_the_run_is_refused(tmp_path, where):
    run_dir = _run_folder(tmp_path)
    checkpoint, eval_dir = run_dir / "global_step_2", tmp_path / "eval"
    trainer = {"val_only": True, "resume_mode": "resume_path", "resume_from_path": str(checkpoint),
               "default_local_dir": str(eval_dir), "validation_data_dir": str(eval_dir / "generations"),
               "logger": ["console", "file"], "project_name": PROJECT, "experiment_name": "an-evaluation"}  # fmt: skip
    env = {"VERL_FILE_LOGGER_ROOT": str(eval_dir / "logs")}
    check_evaluation_apart(OmegaConf.create({"trainer": trainer}), env)
    expected = {
        "default_local_dir": ("default_local_dir", str(run_dir), f"trainer.default_local_dir={run_dir}:"),
        "validation_data_dir": ("validation_data_dir", str(checkpoint / "eval"), "trainer.validation_data_dir="),
        "name": ("experiment_name", RUN_NAME, f"trainer.experiment_name={RUN_NAME}: the name of the run"),
    }
    if where == "file_log":
        config = OmegaConf.create({"trainer": trainer, "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {
            "VERL_FILE_LOGGER_ROOT": str(run_dir / "logs")}}}}})  # fmt: skip
        message = f"its metric log={run_dir}/logs/{PROJECT}/an-evaluation.jsonl: trainer.val_only=true evaluates"
    else:
        key, value, message = expected[where]
        config = OmegaConf.create({"trainer": {**trainer, key: value}})
    with pytest.raises(ValueError) as err:
        check_evaluation_apart(config, env)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_step_is_refused_before_python_naming_the_steps_there(tmp_path):
    run_dir = _run_folder(tmp_path)
    complete_checkpoint(run_dir / "global_step_10", 10)
    proc, record = _evaluate(tmp_path, run_dir / "global_step_5")
    assert proc.returncode == 2 and not record.exists(), proc.stderr[-2000:]
    assert f"checkpoint={run_dir}/global_step_5: no such folder; {run_dir} holds the steps: 2 10" in proc.stderr
    proc, _ = _evaluate(tmp_path, tmp_path / "elsewhere" / "global_step_5")
    assert proc.returncode == 2 and "nor its run's folder" in proc.stderr
    proc, _ = _evaluate(tmp_path, Path("/global_step_200"))  # "$CKPTS_DIR/global_step_200" in a shell without it
    assert proc.returncode == 2 and "is the variable before it, e.g. $CKPTS_DIR, set" in proc.stderr


@pytest.mark.parametrize("value", ["YES", "True"])  # any case, as the entry point reads DRY_RUN
def test_dry_run_yes_is_a_dry_run(tmp_path, value):
    run_dir = _run_folder(tmp_path)
    proc, record = _evaluate(tmp_path, run_dir / "global_step_2", DRY_RUN=value)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, env = _driver_call(record)
    assert env["DRY_RUN"] == "1" and "call gtpo.eval" not in record.read_text()
    assert not os.path.exists(run_dir.parent / f"{RUN_NAME}-eval-step2")
