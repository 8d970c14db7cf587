"""GTPO through verl's real multi-turn ``ToolAgentLoop`` on CPU: the tool task of ``gtpo.cpu.tool_task``.

    .venv/bin/python -m pytest -q -n 0 tests/test_e2e_tool_use.py                      # the default tier's run
    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -n 0 tests/test_e2e_tool_use.py    # + GTPO and GRPO learning it

The prompt names a key; only a call of the ``lookup`` tool reveals the digit stored under it (a different digit per
row), and the reward is 1 for that digit right after the tool's reply. The default tier trains two GTPO steps on the
session's cluster and checks that the tool was called through verl's agent loop with the recipe's parser, that its
output sits in the response masked (``response_mask`` 0), that the tool metrics reach the trainer's log under
``gtpo/``, and that the token dump keeps the tool tokens, marked and without advantage or entropy, which the heatmap
draws grey without a strip. The slow tier trains GTPO and GRPO from the same seed for 150 steps each and checks
that the reward rises under both.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.support.e2e import assert_ran, run_recipe

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def tool_assets():
    from gtpo.cpu.tool_task import build_tool_task_assets

    return build_tool_task_assets()


def tool_run(assets, method: str, steps: int, seed: int, rollout_dir) -> list[str]:
    """The CPU demo's trainer settings with the tool task's (``python -m gtpo.cpu.demo --task tool_lookup``)."""
    from gtpo.cpu.demo_trainer import demo_overrides
    from gtpo.cpu.tool_task import tool_task_overrides

    settings = demo_overrides(assets, steps, seed, rollout_dir, experiment=f"tool_{method}_s{seed}", method=method)
    return [f"method={method}", *settings, *tool_task_overrides(assets)]


def test_gtpo_trains_through_the_tool_agent_loop_with_the_tool_output_masked(ray_cluster, tool_assets, tmp_path):
    from gtpo.cpu.tool_task import REPLY_WORD
    from gtpo.viz.tokens import load_responses, render_html

    rollouts = tmp_path / "rollouts"
    result = run_recipe(ray_cluster, tmp_path, tool_run(tool_assets, "gtpo", 2, 0, rollouts), name="tool_gtpo")
    assert_ran(result, steps=2)
    for entry in result.metrics:
        data = entry["data"]
        # the random model calls the tool in about a third of its responses (the parser stops at `lookup`)
        assert 0 < data["gtpo/tool_outputs_per_response"] <= 1, data
        assert data["training/num_turns/max"] == 4  # user prompt, the call, the tool's reply, the answer
        assert 0 < data["gtpo/masked_token_frac"] < 1 and math.isfinite(data["gtpo/entropy_after_tool_mean"])
        assert data["gtpo/estimator_rows"] == 128.0  # 8 prompts x 16 responses, each shaped once
    records = [json.loads(line) for line in (rollouts / "tokens_2.jsonl").read_text().splitlines()]
    with_tool = [r for r in records if r["model_mask"] is not None]
    assert with_tool, "no dumped response called the tool"
    for rec in with_tool:
        tool = [i for i, own in enumerate(rec["model_mask"]) if not own]
        # the reply as the chat template renders it: "<|im_start|> result <d> <|im_end|>", all masked
        assert [rec["response_tokens"][i] for i in tool][:2] == ["<|im_start|>", REPLY_WORD]
        assert all(rec["advantages"][i] is None and rec["entropy"][i] is None for i in tool)
        assert all(rec["advantages"][i] is not None for i, own in enumerate(rec["model_mask"]) if own)
    page = render_html(load_responses(rollouts / "tokens_2.jsonl"), tmp_path / "heatmap.html").read_text()
    grey = re.findall(r'<span class="tok" [^>]*data-tool[^>]*>', page)
    assert grey and not any("border-bottom" in span for span in grey)


@pytest.mark.slow
def test_gtpo_and_grpo_learn_to_call_the_tool_and_copy_its_reply(ray_cluster, tool_assets, tmp_path):
    """150 steps each from seed 0: the mean reward of the last 20 steps is well above that of the first 20, and the
    responses call the tool far more often at the end."""
    steps, window = 150, 20
    for method in ("gtpo", "grpo"):
        result = run_recipe(
            ray_cluster, tmp_path / method, tool_run(tool_assets, method, steps, 0, None), name=method, timeout=3600
        )
        assert_ran(result, steps=steps)
        reward, turns = result.series("critic/score/mean"), result.series("training/num_turns/mean")
        first, last = sum(reward[:window]) / window, sum(reward[-window:]) / window
        assert last >= first + 0.2, (method, first, last)
        assert sum(turns[-window:]) / window > sum(turns[:window]) / window + 0.5, (method, turns)
