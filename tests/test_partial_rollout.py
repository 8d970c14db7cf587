"""verl's partial-rollout protocol on the CPU ``hf`` rollout server (abort, park, resume), without Ray.

    .venv/bin/python -m pytest -q tests/test_partial_rollout.py

The async trainers abort every replica when a step starts training (``on_sample_end``) and resume them after the
weight sync; verl's ``FullyAsyncLLMServerClient`` resubmits prompt + partial response until the answer is not
``aborted``. These tests play the client's part on a real tiny model.
"""

from __future__ import annotations

import asyncio

import pytest

from gtpo.cpu.hf_rollout import HFRolloutServer, HFSampler, load_causal_lm
from gtpo.cpu.tiny_assets import build_tiny_assets

PROMPT = [9707, 11, 1879, 0, 220, 16, 17, 18]
# A response budget long enough that an abort lands mid-generation, never-ending: ignore_eos.
LONG = {"temperature": 1.0, "logprobs": True, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(build_tiny_assets().model_dir)


@pytest.fixture()
def server(model):
    sampler = HFSampler(model, eos_token_ids=[151645], max_model_len=512, seed=0, pad_token_id=151643)
    return HFRolloutServer(config={"prompt_length": 32, "response_length": 400}, sampler=sampler)


async def _until_generating(server: HFRolloutServer) -> None:
    while server._worker is None or server._queue:  # the batch has been handed to the sampler thread
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)


def test_abort_cuts_the_batch_short_and_resubmission_waits_for_resume(server):
    async def run():
        first = asyncio.create_task(server.generate(prompt_ids=PROMPT, sampling_params=dict(LONG), request_id="a"))
        await _until_generating(server)
        stats = await server.abort_all_requests()
        partial = await first
        # the client's resubmission: prompt + what was generated, the rest of the budget
        rest = dict(LONG, max_tokens=LONG["max_tokens"] - len(partial.token_ids))
        resumed = asyncio.create_task(
            server.generate(prompt_ids=PROMPT + partial.token_ids, sampling_params=rest, request_id="a")
        )
        await asyncio.sleep(0.2)
        parked = not resumed.done() and not server._queue  # waiting at the gate, not queued for the sampler
        await server.resume_generation()
        return stats, partial, parked, await resumed

    stats, partial, parked, resumed = asyncio.run(run())
    assert stats["aborted_count"] == 1
    assert partial.stop_reason == "aborted"
    assert 0 < len(partial.token_ids) < LONG["max_tokens"], len(partial.token_ids)
    assert len(partial.log_probs) == len(partial.token_ids)
    assert parked, "a request submitted after the abort ran before resume_generation"
    assert resumed.stop_reason == "completed"
    assert len(partial.token_ids) + len(resumed.token_ids) == LONG["max_tokens"]


def test_queued_requests_are_answered_aborted_and_reject_mode_answers_at_once(server):
    async def run():
        running = asyncio.create_task(server.generate(prompt_ids=PROMPT, sampling_params=dict(LONG)))
        await _until_generating(server)
        queued = asyncio.create_task(server.generate(prompt_ids=PROMPT, sampling_params=dict(LONG)))
        await asyncio.sleep(0)  # queued behind the running batch
        stats = await server.abort_all_requests(reject_request=True)
        late = await asyncio.wait_for(server.generate(prompt_ids=PROMPT, sampling_params=dict(LONG)), timeout=5)
        await server.resume_generation()
        after = await server.generate(prompt_ids=PROMPT, sampling_params=dict(LONG, max_tokens=2))
        return stats, await running, await queued, late, after

    stats, running, queued, late, after = asyncio.run(run())
    assert stats["aborted_count"] == 2
    assert running.stop_reason == "aborted" and 0 < len(running.token_ids) < LONG["max_tokens"]
    assert queued.stop_reason == "aborted" and queued.token_ids == [] and queued.log_probs == []
    assert late.stop_reason == "aborted" and late.token_ids == []  # rejected: re-routed by the client
    assert after.stop_reason == "completed" and len(after.token_ids) == 2


def test_without_an_abort_nothing_is_cut(server):
    out = asyncio.run(server.generate(prompt_ids=PROMPT, sampling_params=dict(LONG, max_tokens=12)))
    assert out.stop_reason == "completed" and len(out.token_ids) == 12
