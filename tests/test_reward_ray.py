"""The math reward inside Ray actors of the kinds verl's reward loop uses: threaded and async (not silent zeros).

Plain math-verify raises ValueError in both (its SIGALRM timeouts need the main thread), which wrappers that catch
exceptions turn into all-zero rewards. Here the reward must return the right verdicts.

Run: cd /work/main && .venv/bin/pytest -q tests/test_reward_ray.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])
JOBS = [(rf"step... \boxed{{{i}}}", str(i if i % 2 else i + 1)) for i in range(12)]
EXPECTED = [bool(i % 2) for i in range(12)]
TOWER = r"\boxed{\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}}"


def _env():
    path = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": REPO + (os.pathsep + path if path else "")}}


@pytest.fixture(scope="module")
def actors(ray_session):
    ray = ray_session

    @ray.remote(max_concurrency=4)
    class ThreadedGrader:
        def grade(self, response, gold):
            import threading

            from gtpo.reward.math import compute_score

            out = compute_score("math", response, gold, timeout_s=4)
            return out, threading.current_thread() is threading.main_thread()

    @ray.remote
    class AsyncGrader:
        async def grade_like_verl(self, response, gold):
            """What verl's naive reward manager does: sync reward fn via run_in_executor inside an async actor."""
            import asyncio

            from omegaconf import OmegaConf
            from verl.trainer.ppo.reward import get_custom_reward_fn

            cfg = OmegaConf.create(
                {"reward": {"custom_reward_function": {"path": "pkg://gtpo.reward.math", "name": "compute_score"}}}
            )
            fn = get_custom_reward_fn(cfg)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                None, lambda: fn(data_source="math", solution_str=response, ground_truth=gold, extra_info={})
            )

        async def grade_async(self, response, gold):
            from gtpo.reward.math import compute_score_async

            return await compute_score_async("math", response, gold, timeout_s=4)

        async def grade_sync_on_loop(self, response, gold):
            from gtpo.reward.math import compute_score

            return compute_score("math", response, gold, timeout_s=4)

    return ThreadedGrader.options(runtime_env=_env()).remote(), AsyncGrader.options(runtime_env=_env()).remote()


def test_threaded_actor_scores(actors, ray_session):
    threaded, _ = actors
    results = ray_session.get([threaded.grade.remote(r, g) for r, g in JOBS], timeout=120)
    assert [out["acc"] for out, _ in results] == EXPECTED
    assert [out["score"] for out, _ in results] == [1.0 if e else -1.0 for e in EXPECTED]
    # the point of the test: at least some calls ran off the actor's main thread
    assert not all(on_main for _, on_main in results)


@pytest.mark.parametrize("method", ["grade_like_verl", "grade_async", "grade_sync_on_loop"])
def test_async_actor_scores(actors, ray_session, method):
    _, async_actor = actors
    results = ray_session.get([getattr(async_actor, method).remote(r, g) for r, g in JOBS], timeout=120)
    assert [out["acc"] for out in results] == EXPECTED
    assert all(out["grade_status"] == "ok" for out in results)


def test_pathological_input_in_async_actor_is_bounded(actors, ray_session):
    _, async_actor = actors
    import time

    t0 = time.monotonic()
    out = ray_session.get(async_actor.grade_async.remote(TOWER, "5"), timeout=60)
    assert out["acc"] is False and out["grade_status"] == "timeout"
    assert time.monotonic() - t0 < 15
