"""Math reward on Qwen3-style responses with a ``<think>...</think>`` block (thinking mode of a hybrid model).

The reward does not parse think tags: it grades the last ``\\boxed{}`` or ``Answer:`` line anywhere in the response
(gtpo/reward/extract.py). After a closed think block that is the final answer; a box that only appears inside the
block (the final answer unboxed, or the response cut off while thinking) is graded like any other last box. The
qwen3_32b preset trains with thinking off (configs/model/qwen3_32b.yaml), so its responses carry no think block.

Run: cd /work/main && .venv/bin/pytest -q tests/test_reward_think.py
"""

from __future__ import annotations

import pytest

from gtpo.reward.extract import extract_answer
from gtpo.reward.math import compute_score

# A thinking trace that tries 5 (boxed) before settling on 7, then the final answer after the block.
THINK_THEN_ANSWER = (
    "<think>\nThe sum of 3 and 4... maybe \\boxed{5}? No: 3 + 4 = 7.\n</think>\n\n"
    "Adding the two numbers gives $3 + 4 = 7$, so the answer is $\\boxed{7}$."
)
# The only box is inside the block; the text after it states the answer without a box or an Answer: line.
BOX_ONLY_IN_THINK = "<think>\n3 + 4 = 7, so \\boxed{7}.\n</think>\n\nThe answer is 7."
# Cut off while thinking (no closing tag), after a box.
TRUNCATED_THINK = "<think>\nFirst guess \\boxed{7}; let me double-check by counting one by one: 1, 2, 3"


def grade(response: str, gold: str, mode: str) -> tuple[bool, str, str]:
    out = compute_score("math", response, gold, extraction=mode, timeout_s=10)
    assert out["score"] == (1.0 if out["acc"] else -1.0)
    return out["acc"], out["grade_status"], out["pred"]


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_the_box_after_the_think_block_is_the_graded_answer(mode):
    """With a box in the trace and another after ``</think>``, the one after the block is the answer: the right
    final answer scores +1 although the trace boxed a wrong one."""
    assert extract_answer(THINK_THEN_ANSWER) == ("7", "ok")
    assert grade(THINK_THEN_ANSWER, "7", mode) == (True, "ok", "7")


def test_a_wrong_final_answer_is_not_rescued_by_the_trace_in_strict_mode():
    """Strict (training) mode: the trace's box 5 does not count when the final box says 7 and the gold is 5."""
    assert grade(THINK_THEN_ANSWER, "5", "strict") == (False, "ok", "7")


def test_a_box_only_inside_the_think_block_is_graded():
    """No box and no Answer: line after the block: the trace's last box is the answer (think tags are not parsed),
    so a right one scores +1 and a wrong one -1, in both modes."""
    assert extract_answer(BOX_ONLY_IN_THINK) == ("7", "ok")
    for mode in ("strict", "lenient"):
        assert grade(BOX_ONLY_IN_THINK, "7", mode) == (True, "ok", "7")
    assert grade(BOX_ONLY_IN_THINK, "8", "strict") == (False, "ok", "7")


def test_an_answer_line_after_the_block_wins_over_a_box_inside_it():
    """DAPO's ``Answer:`` line after ``</think>`` starts later than the trace's box, so it is the answer."""
    response = "<think>\nTry \\boxed{5}. No, 7.\n</think>\n\nAnswer: 7"
    assert extract_answer(response) == ("7", "ok")
    assert grade(response, "7", "strict") == (True, "ok", "7")


def test_a_response_cut_off_while_thinking_is_graded_on_its_last_box():
    """A trace truncated at the response limit (no ``</think>``) still has its last complete box graded."""
    assert extract_answer(TRUNCATED_THINK) == ("7", "ok")
    assert grade(TRUNCATED_THINK, "7", "strict") == (True, "ok", "7")
    assert grade("<think>\nLet me count: 1, 2, 3", "7", "strict") == (False, "no_answer", "")
