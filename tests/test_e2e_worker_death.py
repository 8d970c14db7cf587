"""One vLLM engine dies in the middle of a run at world size two: the run ends by itself, naming what died, and a
resume continues from the newest complete checkpoint with nothing lost.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -m e2e tests/test_e2e_worker_death.py

The slow tier (tests/conftest.py); the default tier kills one FSDP rank in tests/test_e2e_resume.py. vLLM's engine
core process (``VLLM::EngineCore``, one per replica) is killed with ``kill -9`` after step 3; vLLM's front end in
verl's ``vLLMHttpServer`` raises ``EngineDeadError`` at the next request or weight sync, which reaches the trainer
within seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.support.e2e import WORLD_SIZE_2, RunningRecipe, base_overrides, process_ids, read_metrics, run_recipe, tail

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# How long the run may take to end after an engine died (seconds in practice; room for a loaded 2-core machine).
ENGINE_DEATH_BOUND_S = 120


def test_a_dead_vllm_engine_ends_the_run_and_the_resume_loses_nothing(ray_cluster, tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    overrides = base_overrides(tiny_assets) + [
        *WORLD_SIZE_2,
        "method=gtpo",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
    ]
    metrics = tmp_path / "first.metrics.jsonl"
    first = RunningRecipe(ray_cluster, tmp_path, overrides + ["trainer.total_training_steps=30"], "first", None)
    first.wait_until(lambda: len(read_metrics(metrics)) >= 3, timeout=900)
    engines = process_ids("VLLM::EngineCore")
    assert len(engines) == 2, f"one engine per replica expected, found {engines}"
    killed_at = time.monotonic()
    os.kill(engines[-1], signal.SIGKILL)
    first.proc.wait(timeout=ENGINE_DEATH_BOUND_S)
    ended_after = time.monotonic() - killed_at
    first.kill_job()
    assert first.proc.returncode != 0 and ended_after < ENGINE_DEATH_BOUND_S, (first.proc.returncode, ended_after)
    assert "EngineDeadError" in first.log, tail(first.log)
    done = [r["step"] for r in read_metrics(metrics)]
    assert done[:3] == [1, 2, 3] and len(done) < 30

    newest = max(s for s in (2, 4, 6, 8) if (ckpt / f"global_step_{s}" / "gtpo_state.json").exists())
    resumed = run_recipe(
        ray_cluster, tmp_path, overrides + [f"trainer.total_training_steps={newest + 2}", "trainer.resume_mode=auto"],
        name="resumed", metrics_name="first",
    )  # fmt: skip
    assert resumed.returncode == 0, tail(resumed.log)
    assert f"resumed from {ckpt / f'global_step_{newest}'} at step {newest}" in resumed.log, tail(resumed.log)
    assert [r["step"] for r in read_metrics(metrics)] == list(range(1, newest + 3))
