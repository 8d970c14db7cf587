"""scripts/eval_checkpoint.sh end to end on CPU: a checkpoint of the tiny model, validation only, then gtpo.eval; and
an evaluation beside a run that still trains.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -m e2e tests/test_eval_checkpoint.py

A one-step run of the recipe saves ``global_step_1``; the evaluation command then runs verl's validation alone on it
(``trainer.val_only=true``, resumed from the checkpoint) through a launch script with the CPU backend, dumps every
response (``trainer.validation_data_dir``), and regrades the dump with ``python -m gtpo.eval``, which prints the
Table 1 columns. The tiny model's answers are wrong, so the test checks the plumbing, not the accuracy: the
checkpoint's step, both benchmarks, n samples per problem, the in-loop names and the printed columns.

Beside a live run, the evaluation of one of its checkpoints starts from the shell that launched the run (its
``EXP_NAME``, ``CKPTS_DIR`` and log folder still set) while the run trains and saves; the run goes on until the test
stops it (SIGUSR1: save, exit 85), so what overlaps is the test's to decide, not the machine's speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from gtpo.trainer.preemption.stop import EXIT_CODE
from gtpo.trainer.resume.checkpoints import TRACKER_FILE
from tests.support.e2e import REPO_ROOT, RunningRecipe, base_overrides, read_metrics, run_recipe, tail

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_SAMPLES = 4


def _training(assets) -> list[str]:
    """A GTPO training run of the tiny model, rewarded by the coin."""
    return [*base_overrides(assets), "method=gtpo", "algorithm.filter_groups.enable=false"]


def _benchmarks(assets, folder: Path) -> list[Path]:
    """The tiny validation prompts relabelled as two of Table 1's benchmarks, one parquet each."""
    rows = pd.read_parquet(assets.val_parquet)
    paths = []
    for name, part in (("aime2024", rows.iloc[:2]), ("math500", rows.iloc[2:4])):
        path = folder / f"{name}.parquet"
        part.assign(data_source=name).to_parquet(path, index=False)
        paths.append(path)
    return paths


def _launcher(tmp_path: Path, assets, val_files: list[Path], log_path: Path | None) -> Path:
    """A launch script for the CPU backend, shaped like scripts/run_*.sh: its overrides, then the caller's. With no
    ``log_path`` it names its run as scripts/run.sh does: ``EXP_NAME`` and ``CKPTS_DIR`` from the environment, the
    file logger's folder from ``VERL_FILE_LOGGER_ROOT`` (forwarded to Ray by the entry point); without
    ``RAY_ADDRESS`` it then starts a Ray cluster of its own with the CPU backend's resources."""
    script = tmp_path / "run_tiny.sh"
    overrides = [
        "backend=cpu_tiny",
        "method=gtpo",
        "trainer.logger=[console,file]",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer_dir}",
        f"data.train_files={assets.train_parquet}",
        f"data.val_files=[{','.join(map(str, val_files))}]",
        "sampling=paper",
        f"actor_rollout_ref.rollout.val_kwargs.n={N_SAMPLES}",
    ]
    if log_path is not None:
        overrides += ["ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
                      f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={log_path}"]  # fmt: skip
    else:
        overrides += ["trainer.project_name=gtpo-test", "trainer.experiment_name=$EXP_NAME",
                      "trainer.default_local_dir=$CKPTS_DIR"]  # fmt: skip
    body = " \\\n    ".join(f'"{o}"' for o in overrides)
    script.write_text(
        f'#!/usr/bin/env bash\nset -euo pipefail\ncd {REPO_ROOT}\nexec "$PYTHON" -m recipe.gtpo.main_gtpo \\\n'
        f'    {body} \\\n    "$@"\n'
    )
    return script


def test_eval_checkpoint_of_a_one_step_run(ray_cluster, tiny_assets, tmp_path):
    from gtpo.cpu import env as cpu_env

    ckpt = tmp_path / "ckpt"
    train = run_recipe(
        ray_cluster,
        tmp_path,
        [
            *_training(tiny_assets),
            "trainer.total_training_steps=1",
            "trainer.save_freq=1",
            f"trainer.default_local_dir={ckpt}",
        ],
        name="train",
    )
    assert train.returncode == 0, tail(train.log)
    step_dir = ckpt / "global_step_1"
    assert (step_dir / "actor").is_dir(), f"no checkpoint in {ckpt}: {sorted(p.name for p in ckpt.glob('*'))}"

    metrics_path = tmp_path / "eval.metrics.jsonl"
    launcher = _launcher(tmp_path, tiny_assets, _benchmarks(tiny_assets, tmp_path), metrics_path)
    eval_dir = tmp_path / "eval"
    env = dict(os.environ)
    env.update(cpu_env())
    env.update(
        RAY_ADDRESS=ray_cluster.address,
        **ray_cluster.auth_env,
        PYTHON=sys.executable,
        EVAL_DIR=str(eval_dir),
        EVAL_ARGS="--sampling paper --num-workers 1 --no-progress",
        EVAL_N=str(N_SAMPLES),  # the script's default is Table 1's 32 samples per problem
        PYTHONUNBUFFERED="1",
    )
    with open(tmp_path / "eval.log", "wb") as log:
        proc = subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "eval_checkpoint.sh"), str(launcher), str(step_dir)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    out = (tmp_path / "eval.log").read_text(errors="replace")
    assert proc.returncode == 0, tail(out, 80)

    # verl validated the checkpoint's step only: one dump, named after the step, n samples per prompt
    dump = eval_dir / "generations" / "1.jsonl"
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == 4 * N_SAMPLES and {r["step"] for r in rows} == {1}
    sources = json.loads((eval_dir / "generations" / "1.data_sources.json").read_text())
    assert sorted(sources.values()) == ["aime2024", "aime2024", "math500", "math500"]
    # no training step ran: the only logged step is the validation at step 1, with the Table 1 names
    logged = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    assert [m["step"] for m in logged] == [1]
    val = logged[0]["data"]
    for source in ("aime2024", "math500"):
        assert 0.0 <= val[f"val-core/{source}/acc/Mean@{N_SAMPLES}"] <= 1.0
        assert 0.0 <= val[f"val-core/{source}/acc/Pass@4"] <= 1.0
        assert f"val-aux/{source}/acc/pass@1" in val
    assert not any(k.startswith("actor/") for k in val), "a training step ran"

    # gtpo.eval regraded the dump: both benchmarks, the same n, the Table 1 columns printed
    report = json.loads((eval_dir / "eval.json").read_text())["results"]
    assert set(report) == {"aime2024", "math500"}
    assert all(r["n_min"] == r["n_max"] == N_SAMPLES and r["n_problems"] == 2 for r in report.values())
    assert f"| AIME24 Mean@{N_SAMPLES} | AIME24 Pass@4 | AIME24 Pass@32 | MATH500 Mean@{N_SAMPLES} |" in out


def _tree_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}  # fmt: skip


def test_an_evaluation_beside_a_training_run(ray_cluster, tiny_assets, tmp_path):
    """The run saves every 3 steps and keeps every checkpoint; once global_step_3 is complete, it is evaluated from
    a shell that still holds the run's EXP_NAME, CKPTS_DIR and log folder. On the run's own Ray cluster the
    evaluation is refused in one line (exit 2, before its TaskRunner: it would share the run's TransferQueue and
    kill it at its end); on a cluster of its own (no RAY_ADDRESS) it runs to the end while the run trains on
    (alive when the evaluation ends: it has thousands of steps left). Then SIGUSR1 stops the run (save, exit 85).
    The evaluated checkpoint is byte for byte what it was, the evaluation wrote nothing into the run's folder, the
    run's metric log holds every step it trained once, and the evaluation's log its one validation."""
    from gtpo.cpu import env as cpu_env

    run_dir = tmp_path / "ckpts" / "gtpo-test" / "train-run"
    training = RunningRecipe(
        ray_cluster,
        tmp_path / "train",
        [
            *_training(tiny_assets),
            # more steps than the evaluation can overlap: the test ends the run
            "trainer.total_epochs=1000",
            "trainer.total_training_steps=5000",
            "trainer.save_freq=3",
            "trainer.max_actor_ckpt_to_keep=null",
            "trainer.project_name=gtpo-test",
            "trainer.experiment_name=train-run",
            f"trainer.default_local_dir={run_dir}",
        ],
        "train",
        {"VERL_FILE_LOGGER_ROOT": str(run_dir / "logs")},
    )
    run_log = run_dir / "logs" / "gtpo-test" / "train-run.jsonl"
    step_dir = run_dir / "global_step_3"
    launcher = _launcher(tmp_path, tiny_assets, _benchmarks(tiny_assets, tmp_path), None)
    evaluate = ["bash", str(REPO_ROOT / "scripts" / "eval_checkpoint.sh"), str(launcher), str(step_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(cpu_env())
    env.update(
        PYTHON=sys.executable,
        EVAL_ARGS="--sampling paper --num-workers 1 --no-progress",
        EVAL_N=str(N_SAMPLES),
        PYTHONUNBUFFERED="1",
        # the run's own settings, left in the shell that launched it
        EXP_NAME="train-run",
        CKPTS_DIR=str(run_dir),
        VERL_FILE_LOGGER_ROOT=str(run_dir / "logs"),
    )
    try:
        training.wait_until(lambda: (run_dir / TRACKER_FILE).exists(), timeout=1200)
        assert (run_dir / TRACKER_FILE).read_text().strip() == "3"
        evaluated = _tree_hashes(step_dir)

        joined = {**env, "RAY_ADDRESS": ray_cluster.address, **ray_cluster.auth_env}
        on_the_runs_cluster = subprocess.run(
            [*evaluate, "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null"],
            env=joined, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        refusal = "runs another verl job (TransferQueue's controller, one per cluster, is on it)"
        assert on_the_runs_cluster.returncode == 2, tail(on_the_runs_cluster.stdout + on_the_runs_cluster.stderr, 80)
        assert refusal in on_the_runs_cluster.stderr, tail(on_the_runs_cluster.stderr, 80)
        assert "GTPOTaskRunner" not in on_the_runs_cluster.stdout + on_the_runs_cluster.stderr

        with open(tmp_path / "eval.log", "wb") as log:
            proc = subprocess.run(evaluate, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1200)
        out = (tmp_path / "eval.log").read_text(errors="replace")
        assert proc.returncode == 0, tail(out, 80)
        assert "starting a new local Ray cluster of this run's own" in out, tail(out, 80)
        assert training.proc.poll() is None, f"the run ended during the evaluation:\n{tail(training.log)}"
        trained = len(read_metrics(run_log))
        training.wait_until(lambda: len(read_metrics(run_log)) > trained, timeout=600)  # still training
        os.kill(training.proc.pid, signal.SIGUSR1)
        assert training.proc.wait(timeout=600) == EXIT_CODE, tail(training.log)
    except BaseException:
        training.kill_job()  # not left training on the shared cluster after a failure
        raise
    training._log.close()

    # the evaluation's folder, name and log are its own, beside the run's
    eval_dir = run_dir.parent / "train-run-eval-step3"
    assert (eval_dir / "generations" / "3.jsonl").is_file() and (eval_dir / "eval.json").is_file()
    eval_log = eval_dir / "logs" / "gtpo-test" / "train-run-eval-step3.jsonl"
    assert [m["step"] for m in read_metrics(eval_log)] == [3]
    # the run's checkpoint untouched, nothing of the evaluation inside the run's folder
    assert _tree_hashes(step_dir) == evaluated, "the evaluation changed the checkpoint it evaluated"
    assert not [p for p in run_dir.rglob("*") if "eval" in p.name], sorted(run_dir.rglob("*eval*"))
    # every step the run trained logged once, up to the one its stop saved
    stopped = int((run_dir / TRACKER_FILE).read_text().strip())
    assert stopped > 3
    assert [m["step"] for m in read_metrics(run_log)] == list(range(1, stopped + 1))
