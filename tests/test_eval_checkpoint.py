"""scripts/eval_checkpoint.sh end to end on CPU: a checkpoint of the tiny model, validation only, then gtpo.eval.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -m e2e tests/test_eval_checkpoint.py

A one-step run of the recipe saves ``global_step_1``; the evaluation command then runs verl's validation alone on it
(``trainer.val_only=true``, resumed from the checkpoint) through a launch script with the CPU backend, dumps every
response (``trainer.validation_data_dir``), and regrades the dump with ``python -m gtpo.eval``, which prints the
Table 1 columns. The tiny model's answers are wrong, so the test checks the plumbing, not the accuracy: the
checkpoint's step, both benchmarks, n samples per problem, the in-loop names and the printed columns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.support.e2e import REPO_ROOT, run_recipe, tail

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COIN_REWARD = REPO_ROOT / "tests" / "assets" / "coin_reward.py"
N_SAMPLES = 4


def _benchmarks(assets, folder: Path) -> list[Path]:
    """The tiny validation prompts relabelled as two of Table 1's benchmarks, one parquet each."""
    rows = pd.read_parquet(assets.val_parquet)
    paths = []
    for name, part in (("aime2024", rows.iloc[:2]), ("math500", rows.iloc[2:4])):
        path = folder / f"{name}.parquet"
        part.assign(data_source=name).to_parquet(path, index=False)
        paths.append(path)
    return paths


def _launcher(tmp_path: Path, assets, val_files: list[Path], log_path: Path) -> Path:
    """A launch script for the CPU backend, shaped like scripts/run_*.sh: its overrides, then the caller's."""
    script = tmp_path / "run_tiny.sh"
    overrides = [
        "backend=cpu_tiny",
        "method=gtpo",
        "ray_kwargs.ray_init.num_cpus=null",
        "ray_kwargs.ray_init.num_gpus=null",
        "trainer.logger=[console,file]",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={log_path}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer_dir}",
        f"data.train_files={assets.train_parquet}",
        f"data.val_files=[{','.join(map(str, val_files))}]",
        "sampling=paper",
        f"actor_rollout_ref.rollout.val_kwargs.n={N_SAMPLES}",
    ]
    body = " \\\n    ".join(f"'{o}'" for o in overrides)
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
            f"actor_rollout_ref.model.path={tiny_assets.model_dir}",
            f"actor_rollout_ref.model.tokenizer_path={tiny_assets.tokenizer_dir}",
            f"data.train_files={tiny_assets.train_parquet}",
            f"data.val_files={tiny_assets.val_parquet}",
            f"reward.custom_reward_function.path={COIN_REWARD}",
            "method=gtpo",
            "algorithm.filter_groups.enable=false",
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
