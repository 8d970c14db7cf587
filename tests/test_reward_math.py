"""Math reward: extraction, equivalence verdicts, hard time limits, threads/async/fork safety.

Run: cd /work/main && .venv/bin/pytest -q tests/test_reward_math.py
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gtpo.reward.extract import MAX_ANSWER_CHARS, clean_answer, extract_answer, last_boxed, normalize_for_vote
from gtpo.reward.math import (
    GRADE_STATUSES,
    RESULT_KEYS,
    compute_score,
    compute_score_async,
    compute_score_inline,
    compute_scores_batch,
)
from gtpo.reward.pool import GraderPool, get_pool

TOWER = r"\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}"
MB = 1_000_000

# (response, gold, expected acc, expected grade_status or None for "ok", wall-time bound in seconds)
# Grading limit per call, and the wall-time bound of a call that may use it all (plus a worker restart): generous,
# since the trainer runs of the other test worker share the 2 cores; the bound of 2 s is for inputs refused unparsed.
LIMIT_S = 20
BOUND_S = LIMIT_S + 4
CASES = [
    (r"So \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}", True, "ok", BOUND_S),
    (r"\boxed{0.5}", r"\frac12", True, "ok", BOUND_S),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", True, "ok", BOUND_S),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", False, "ok", BOUND_S),
    (r"\boxed{-3}", "-3", True, "ok", BOUND_S),
    (r"\boxed{3}", "-3", False, "ok", BOUND_S),
    (r"\boxed{(1,2]}", "(1,2]", True, "ok", BOUND_S),
    (r"\boxed{[1,2]}", "(1,2]", False, "ok", BOUND_S),
    (r"\boxed{[-2,\infty)}", r"[-2,\infty)", True, "ok", BOUND_S),
    (r"first \boxed{3}, finally \boxed{4}", "4", True, "ok", BOUND_S),
    (r"first \boxed{3}, finally \boxed{4}", "3", False, "ok", BOUND_S),
    ("The answer is 5", "5", False, "no_answer", 2),
    ("", "5", False, "no_answer", 2),
    (None, "5", False, "no_answer", 2),
    (r"\boxed{}", "5", False, "no_answer", 2),
    (r"\boxed{5", "5", False, "unclosed", 2),
    ("x" * MB + r" \boxed{7}", "7", True, "ok", BOUND_S),
    (r"\boxed{" + "1" * 100_000 + "}", "1", False, "too_long", BOUND_S),
    # only the response's tail is searched: a box opening 1 MB before the end is not seen
    (r"\boxed{" + "1" * MB + "}", "1", False, "no_answer", BOUND_S),
    ("word " * (MB // 5), "7", False, "no_answer", BOUND_S),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", True, "ok", BOUND_S),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", True, "ok", BOUND_S),
    (r"\boxed{" + TOWER + "}", "5", False, "timeout", BOUND_S),
    ("Reasoning...\nAnswer: 34", "34", True, "ok", BOUND_S),
    ("**Answer:** $\\frac{3}{4}$", r"\frac34", True, "ok", BOUND_S),
    (r"Answer: \boxed{12}", "12", True, "ok", BOUND_S),
    ("We get \\boxed{3} first.\nAnswer: 5", "5", True, "ok", BOUND_S),
    ("Answer: 3 was wrong; recheck: \\boxed{5}", "5", True, "ok", BOUND_S),
    ("答案\nAnswer：5", "5", True, "ok", BOUND_S),
    ("## Final Answer: 8", "8", True, "ok", BOUND_S),
    # "answer:" inside prose is not the DAPO answer line; the earlier box stands
    ("So \\boxed{44}.\nWe may check our answer: $17 \\cdot 44 = 748$.", "44", True, "ok", BOUND_S),
    (r"\boxed{10\text{ cm}}", "10", True, "ok", BOUND_S),
    (r"\boxed{50\%}", "50", True, "ok", BOUND_S),
    (r"\boxed{50}", r"50\%", True, "ok", BOUND_S),
    (r"\boxed{90^\circ}", "90", True, "ok", BOUND_S),
    (r"\boxed{x=5}", "5", True, "ok", BOUND_S),
    (r"\boxed{1,000}", "1000", True, "ok", BOUND_S),
    (r"\boxed{2^{1/2}}", r"\sqrt{2}", True, "ok", BOUND_S),
    (r"\boxed 5", "5", True, "ok", BOUND_S),
    (r"\fbox{5}", "5", True, "ok", BOUND_S),
    (r"\boxed{5.}", "5", True, "ok", BOUND_S),
    (r"\boxed{3.14159}", r"\pi", False, "ok", BOUND_S),
    (r"\boxed{\left(3, \frac{\pi}{2}\right)}", r"\left( 3, \frac{\pi}{2} \right)", True, "ok", BOUND_S),
    (r"\boxed{3+4}", "7", True, "ok", BOUND_S),
    (r"\boxed{\frac{}{}}", "1", False, "parse_error", BOUND_S),
    (r"\boxed{7}", r"\boxed{7}", True, "ok", BOUND_S),
    (r"\boxed{\infty}", r"\infty", True, "ok", BOUND_S),
]


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    # start one worker up front so per-call bounds below measure grading, not interpreter start-up
    assert compute_score("w", r"\boxed{1}", "1")["acc"] is True


@pytest.mark.parametrize("response,gold,acc,status,bound", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_grading_cases(response, gold, acc, status, bound):
    t0 = time.monotonic()
    out = compute_score("math", response, gold, timeout_s=LIMIT_S)
    elapsed = time.monotonic() - t0
    assert out["acc"] is acc, out
    assert out["grade_status"] == status, out
    assert out["score"] == (1.0 if acc else -1.0)
    assert elapsed < bound, f"{elapsed:.2f}s"


def test_case_count():
    assert len(CASES) >= 30


def test_result_schema_is_stable_and_json_friendly():
    outs = [compute_score("d", r, g) for r, g, *_ in CASES[:16]]
    for out in outs:
        assert tuple(out) == RESULT_KEYS
        assert isinstance(out["score"], float) and isinstance(out["acc"], bool) and isinstance(out["pred"], str)
        assert out["grade_status"] in GRADE_STATUSES
        json.dumps(out)
    # verl stacks each key across samples with np.array
    assert np.array([o["acc"] for o in outs]).dtype == bool
    assert np.array([o["pred"] for o in outs]).dtype.kind == "U"


def test_pred_is_extracted_answer():
    assert compute_score("d", r"so \boxed{\frac{3}{4}}.", "0.75")["pred"] == r"\frac{3}{4}"
    assert compute_score("d", "Answer: $12$.", "12")["pred"] == "12"
    assert compute_score("d", "nothing", "12")["pred"] == ""


def test_binary_score_mode_via_kwargs_and_extra_info():
    assert compute_score("d", r"\boxed{2}", "2", score_mode="binary")["score"] == 1.0
    assert compute_score("d", r"\boxed{3}", "2", score_mode="binary")["score"] == 0.0
    assert compute_score("d", r"\boxed{3}", "2", extra_info={"score_mode": "binary"})["score"] == 0.0
    # kwargs (verl's reward_kwargs) win over extra_info
    assert compute_score("d", r"\boxed{3}", "2", {"score_mode": "binary"}, score_mode="pm1")["score"] == -1.0
    with pytest.raises(ValueError, match="score_mode='bogus'"):
        compute_score("d", r"\boxed{3}", "2", score_mode="bogus")


def test_unknown_kwargs_and_odd_ground_truths():
    out = compute_score("d", r"\boxed{4}", "4", extra_info={"num_turns": 2}, reward_router_address=None)
    assert out["acc"]
    assert compute_score("d", r"\boxed{4}", 4)["acc"]
    assert compute_score("d", r"\boxed{4}", np.str_("4"))["acc"]
    assert compute_score("d", r"\boxed{4}", ["3", "4"])["acc"]
    assert compute_score("d", r"\boxed{4}", np.array(["3", "5"], dtype=object))["acc"] is False
    assert compute_score("d", rb"\boxed{4}", "4")["acc"]
    assert compute_score("d", r"\boxed{4}", "")["grade_status"] == "gold_error"
    assert compute_score("d", r"\boxed{4}", "x" * (MAX_ANSWER_CHARS + 1))["grade_status"] == "too_long"


def test_extraction_helpers():
    assert last_boxed(r"\boxed{a{b}c} and \boxed{\frac{1}{2}}")[0] == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{x\}}")[0] == r"\{x\}"
    assert extract_answer("Answer: **42**")[0] == "42"
    assert extract_answer("nothing here") == (None, "no_answer")
    assert normalize_for_vote(r"\dfrac{1}{2}") == normalize_for_vote(r"\frac{1}{2}") == r"\frac{1}{2}"
    assert normalize_for_vote(r"\left( 1, 2 \right)") == "(1,2)"
    assert normalize_for_vote(r"10\text{ cm}") == "10cm"
    assert normalize_for_vote(r"\text {5}") == normalize_for_vote(r"\text{ 5 }") == normalize_for_vote("5") == "5"
    assert normalize_for_vote(None) == ""


@pytest.mark.parametrize(
    "answer,vote",
    [
        ("", ""),
        (r"\tfrac{1}{2}", r"\frac{1}{2}"),
        (r"\text{5.50}", "5.50"),
        (r"\textbf{5}", "5"),
        (r"\mathrm{m}", "m"),
        (r"\mbox{x}", "x"),
        (r"\text{a}+\text{b}", "a+b"),
        (r"\text{\frac{1}{2}}", r"\text{\frac{1}{2}}"),  # only a command around plain text is unwrapped
        (r"\textrm{5}", r"\textrm{5}"),
        (r"x\text{ }", "x"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"\displaystyle 5", "5"),
        (r"1\,000", "1000"),
        (r"1\!2", "12"),
        (r"a\;b\:c\ d", "abcd"),
        (r"\left[ 1, 2 \right)", "[1,2)"),
        ("5.", "5"),
        ("5 ;.", "5"),
        ("0.5", "0.5"),
        ("1/2", "1/2"),
    ],
)
def test_normalize_for_vote(answer, vote):
    assert normalize_for_vote(answer) == vote


def test_hard_kill_when_soft_alarm_cannot_fire():
    # with math-verify's alarms disabled the power tower never returns (C-level bigint work holding the GIL):
    # only the wall-clock kill ends it, and the pool keeps working afterwards
    pool = GraderPool(max_workers=1)
    try:
        assert pool.grade("5", "5", timeout_s=30) == (True, "ok")
        pid = pool.worker_pids()[0]
        t0 = time.monotonic()
        assert pool.grade("5", TOWER, timeout_s=1.5, soft_timeout_s=0) == (False, "timeout")
        assert time.monotonic() - t0 < 4
        assert pool.n_killed == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert pool.grade("5", "5", timeout_s=30) == (True, "ok")
    finally:
        pool.shutdown()


def test_busy_pool_is_bounded():
    pool = GraderPool(max_workers=1)
    try:
        with ThreadPoolExecutor(2) as ex:
            slow = ex.submit(pool.grade, "5", TOWER, 3.0, 600.0, 0)
            time.sleep(0.5)
            t0 = time.monotonic()
            assert pool.grade("5", "5", timeout_s=3, queue_timeout_s=0.3) == (False, "busy")
            assert time.monotonic() - t0 < 2
            assert slow.result() == (False, "timeout")
    finally:
        pool.shutdown()


def test_threads_get_real_scores():
    # math-verify alone raises ValueError off the main thread (-> silent zeros in naive wrappers)
    jobs = [(rf"\boxed{{{i}}}", str(i if i % 3 else i + 1)) for i in range(24)]
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda j: compute_score("d", *j), jobs))
    assert [o["acc"] for o in outs] == [bool(i % 3) for i in range(24)]
    assert all(o["grade_status"] == "ok" for o in outs)


def test_async_inside_event_loop():
    async def main():
        coros = [compute_score_async("d", rf"\boxed{{{i}}}", str(i)) for i in range(8)]
        # a sync call from the event-loop thread (not the main thread of a Ray async actor) must work too
        sync_out = compute_score("d", r"\boxed{9}", "9")
        return await asyncio.gather(*coros), sync_out

    outs, sync_out = asyncio.run(main())
    assert all(o["acc"] for o in outs) and sync_out["acc"]


def test_batch_matches_single_calls():
    responses = [r for r, *_ in CASES if r is None or len(r) < 1000]
    golds = [g for r, g, *_ in CASES if r is None or len(r) < 1000]
    batch = compute_scores_batch(None, responses, golds, num_workers=2, timeout_s=4)
    single = [compute_score("d", r, g, timeout_s=4) for r, g in zip(responses, golds, strict=True)]
    assert [b["acc"] for b in batch] == [s["acc"] for s in single]
    assert [b["pred"] for b in batch] == [s["pred"] for s in single]
    with pytest.raises(ValueError, match="len\\(ground_truths\\)"):
        compute_scores_batch(None, ["a"], ["1", "2"])


def test_inline_matches_pool():
    for r, g, acc, status, _ in CASES:
        if status in ("ok", "no_answer") and (r is None or len(r) < 1000):
            assert compute_score_inline("d", r, g)["acc"] is acc


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_builds_its_own_pool():
    parent_pool = get_pool()
    assert compute_score("d", r"\boxed{2}", "2")["acc"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not reuse the parent's workers
        try:
            ok = compute_score("d", r"\boxed{3}", "3")["acc"] and get_pool() is not parent_pool
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert compute_score("d", r"\boxed{4}", "4")["acc"] and get_pool() is parent_pool


def test_verl_loads_it_with_reward_kwargs():
    """verl's own loader (pkg:// path + reward_kwargs merged into every call)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://gtpo.reward.math",
                    "name": "compute_score",
                    "reward_kwargs": {"score_mode": "binary", "timeout_s": 5},
                }
            }
        }
    )
    fn = get_custom_reward_fn(cfg)
    out = fn(data_source="math", solution_str=r"\boxed{1}", ground_truth="2", extra_info={})
    assert out["score"] == 0.0 and out["grade_status"] == "ok"


# ------------------------------------------------------------------------------------------ extraction modes

# (response, gold, strict (acc, status, pred), lenient (acc, status, pred)): every step of math-verify's default
# extraction order, and what strict mode does with it.
EXTRACTION_CASES = [
    # 1. \boxed first: both modes; in lenient mode a box wins over a later bare number
    (r"so \boxed{\frac{3}{4}} of 12 eggs", "0.75", (True, "ok", r"\frac{3}{4}"), (True, "ok", r"\frac{3}{4}")),
    # 2. "the final answer is ...": lenient only
    (r"So the final answer is $\frac{1}{2}$.", r"\frac12", (False, "no_answer", ""), (True, "ok", r"\frac{1}{2}")),
    # 2b. DAPO's "Answer:" line: both modes
    ("We add them.\nAnswer: 34", "34", (True, "ok", "34"), (True, "ok", "34")),
    # 3. the last LaTeX expression of the text
    (r"Half of it, i.e. $\frac{3}{4}$, remains", "3/4", (False, "no_answer", ""), (True, "ok", r"\frac{3}{4}")),
    # 3b. the last plain expression: 7, not 3
    ("first 3 then 7", "7", (False, "no_answer", ""), (True, "ok", "7")),
    ("first 3 then 7", "3", (False, "no_answer", ""), (False, "ok", "7")),
    # nothing extractable
    ("no digits here", "7", (False, "no_answer", ""), (False, "no_answer", "")),
    ("", "7", (False, "no_answer", ""), (False, "no_answer", "")),
]


@pytest.mark.parametrize("response,gold,strict,lenient", EXTRACTION_CASES, ids=[f"x{i}" for i in range(8)])
def test_extraction_modes(response, gold, strict, lenient):
    for mode, expected in (("strict", strict), ("lenient", lenient)):
        out = compute_score("math", response, gold, extraction=mode, timeout_s=6)
        assert (out["acc"], out["grade_status"], out["pred"]) == expected, (mode, out)
        assert out["score"] == (1.0 if expected[0] else -1.0)
    assert compute_score("math", response, gold, timeout_s=6)["grade_status"] == strict[1]  # strict is the default


def test_lenient_considers_every_box_for_a_set_gold():
    response = r"The roots are $x = \boxed{2}$ and $x = \boxed{3}$."
    strict = compute_score("math", response, "2, 3", timeout_s=6)
    assert (strict["acc"], strict["pred"]) == (False, "3")  # strict: the last box only
    lenient = compute_score("math", response, "2, 3", extraction="lenient", timeout_s=6)
    assert lenient["acc"] is True and lenient["grade_status"] == "ok"
    assert compute_score("math", response, "2, 4", extraction="lenient", timeout_s=6)["acc"] is False


def test_extraction_via_reward_kwargs_batch_and_inline():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    kwargs = {"extraction": "lenient", "timeout_s": 6}
    cfg = OmegaConf.create(
        {"reward": {"custom_reward_function": {"path": "pkg://gtpo.reward.math", "name": "compute_score",
                                               "reward_kwargs": kwargs}}}
    )  # fmt: skip
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="m", solution_str="the answer is 5", ground_truth="5", extra_info={})["acc"] is True
    responses = [r for r, *_ in EXTRACTION_CASES]
    golds = [g for _, g, *_ in EXTRACTION_CASES]
    batch = compute_scores_batch(None, responses, golds, num_workers=2, **kwargs)
    assert [(o["acc"], o["grade_status"], o["pred"]) for o in batch] == [c[3] for c in EXTRACTION_CASES]
    inline = [compute_score_inline("m", r, g, **kwargs) for r, g in zip(responses, golds, strict=True)]
    assert inline == batch
    with pytest.raises(ValueError, match="extraction='loose'"):
        compute_score("m", r"\boxed{1}", "1", extraction="loose")


def test_lenient_is_bounded_and_never_raises():
    t0 = time.monotonic()
    out = compute_score("m", "we get " + TOWER, "5", extraction="lenient", timeout_s=3)
    assert out["acc"] is False and out["grade_status"] in ("timeout", "no_answer", "parse_error", "ok")
    assert time.monotonic() - t0 < 8
    for bad in (None, b"\xff\xfe", 12345, "x" * (3 * MB)):
        assert compute_score("m", bad, "5", extraction="lenient", timeout_s=3)["grade_status"] in GRADE_STATUSES


# ------------------------------------------------------------------- lenient grading is never worse than strict

# The answer in every style a response writes it (``<v>`` is the number as the gold writes it, ``<t>`` with
# thousands separators), and every place a response puts it (``<a>``).
ANSWER_STYLES = (
    "<v>", "<v>\\%", "<v>%", "<v> \\%", "<v>^\\circ", "<v>^{\\circ}", "<v>\\text{ cm}", "<v> \\text{ cm}^2",
    "\\text{<v>}", "\\textbf{<v>}", "\\$<v>", "\\$ <v>", "\\$<v>.", "<v>\\text{ dollars}", "<v>\\,\\mathrm{m}",
    "<t>", "\\$<t>", "<t>\\%",
)  # fmt: skip
ANSWER_PLACES = (
    "\\boxed{<a>}", "$\\boxed{<a>}$", "The rate is $\\boxed{<a>}$.", "So the answer is \\boxed{<a>}.",
    "\\fbox{<a>}", "Answer: <a>", "**Answer:** <a>", "Answer: $<a>$", "Answer: \\boxed{<a>}",
    "We get $x = 3$.\nAnswer: <a>", "First \\boxed{7}, then \\boxed{<a>}",
)  # fmt: skip
# (the number as a response writes it, with separators, and the golds it is equal to)
NUMBERS = (
    ("50", "50", ("50", "50\\%")),
    ("1000", "1,000", ("1000", "1,000")),
    ("12345678", "12{,}345{,}678", ("12345678",)),
    ("5.50", "5.50", ("5.50", "5.5", "\\$5.50")),
    ("\\frac{1}{2}", "\\frac{1}{2}", ("\\frac{1}{2}", "0.5")),
    ("-3", "-3", ("-3",)),
    ("90", "90", ("90", "90^\\circ")),
)


def _styled_cases():
    """``(response, gold, equal)`` for every number, style, place and gold, each once."""
    return list(dict.fromkeys(_styled_products()))


def _styled_products():
    for v, t, golds in NUMBERS:
        wrong = "51" if v == "50" else "11"  # never 7: a place shows an earlier \\boxed{7}, which lenient reads too
        for style in ANSWER_STYLES:
            answer = style.replace("<v>", v).replace("<t>", t)
            for place in ANSWER_PLACES:
                response = place.replace("<a>", answer)
                for gold in golds:
                    yield response, gold, True
                yield response, wrong, False


def test_lenient_is_never_worse_than_strict_over_constructed_styles():
    cases = _styled_cases()
    responses, golds = [c[0] for c in cases], [c[1] for c in cases]
    strict = compute_scores_batch(None, responses, golds, num_workers=2, extraction="strict", timeout_s=6)
    lenient = compute_scores_batch(None, responses, golds, num_workers=2, extraction="lenient", timeout_s=6)
    worse = [(r, g, s, le) for (r, g, _), s, le in zip(cases, strict, lenient, strict=True) if s["acc"] > le["acc"]]
    assert worse == [], f"{len(worse)} responses strict grades right and lenient wrong, e.g. {worse[:3]}"
    right = [(r, g) for (r, g, eq), s in zip(cases, strict, strict=True) if eq and s["acc"]]
    assert len(right) > len(cases) // 2, "the styles must be ones strict grades (else the property says little)"
    false_accepts = [(r, g) for (r, g, eq), le in zip(cases, lenient, strict=True) if not eq and le["acc"]]
    assert false_accepts == [], false_accepts[:5]


@pytest.mark.parametrize(
    "response,gold",
    [
        (r"The rate is $\boxed{50\%}$.", "50"),  # math-verify alone: '50\%' parses to no number
        (r"\boxed{50\%}", r"50\%"),
        (r"\boxed{\frac{1}{2}\%}", r"\frac{1}{2}"),  # math-verify alone reads it as 1/200
        ("Answer: \\$50", "50"),  # matches none of math-verify's answer patterns
    ],
)
def test_lenient_grades_right_what_strict_grades_right(response, gold):
    strict = compute_score("math", response, gold, extraction="strict", timeout_s=6)
    lenient = compute_score("math", response, gold, extraction="lenient", timeout_s=6)
    assert strict["acc"] is True, strict
    assert (lenient["acc"], lenient["grade_status"], lenient["pred"]) == (True, "ok", strict["pred"])


@pytest.mark.parametrize(
    "response,gold,acc",
    [
        (r"\boxed{\text{5.50}}", "5.50", True),  # math-verify alone reads \text{5.50} as text: wrong in both modes
        (r"\boxed{\textbf{5.50}}", "5.50", True),
        (r"Answer: \textbf{5.50}", "5.50", True),
        (r"so $\boxed{\mathrm{ 12 }}$.", "12", True),
        (r"\boxed{\text{5.5}}", "5.50", True),
        (r"\boxed{\text{6.50}}", "5.50", False),  # the number, not a pass for anything in \text{}
        (r"\boxed{\text{5.50 dollars}}", "5.50", False),  # only a lone number is unwrapped
        (r"\boxed{\text{-5.50}}", "-5.5", True),
        (r"\boxed{\text{5.50}}", "-5.50", False),
        (r"\boxed{\text{5.}}", "5", True),
        (r"\boxed{\text{3}\sqrt{2}}", "3", False),  # a number in \text{} beside more maths is not the whole answer
        (r"Answer: $\text{5.50}$", "5.50", True),
        (r"Answer: $\text{5.50}$.", "5.50", True),
        (r"\boxed{\text{ 5.50 }}", "5.5", True),
        (r"\boxed{\text{5.50\%}}", "5.5", True),
        (r"\boxed{\text{5.50}\%}", "5.5", True),
        (r"\boxed{\text{1,000}}", "1000", True),
        (r"\boxed{\mathrm{5.50}}", "5.5", True),
        (r"\boxed{\text{\$5.50}}", "5.50", True),  # the dollar sign goes before the number is unwrapped
        (r"\boxed{\$\text{5.50}}", "5.50", True),
        (r"\boxed{\text{\$6.50}}", "5.50", False),
    ],
)
def test_a_number_in_text_or_bold_type_is_graded_as_the_number(response, gold, acc):
    for mode in ("strict", "lenient"):
        out = compute_score("math", response, gold, extraction=mode, timeout_s=6)
        assert out["acc"] is acc, (mode, out)


@pytest.mark.parametrize(
    "answer,cleaned",
    [
        ("5", "5"),
        (" $5$ ", "5"),
        ("$$ 5 $$", "5"),
        (r"\( 5 \)", "5"),
        (r"\[5\]", "5"),
        ("$5.$", "5"),
        (r"** \(5\) **", "5"),
        ("**5**", "5"),
        ("** 5", "5"),  # what "**Answer:** 5" leaves after the colon
        (r"\(\)", ""),
        ("50%", "50"),
        (r"50\%", "50"),
        (r"\$5.50", "5.50"),
        ("5$", "5"),
        ("5.", "5"),
        ("5,", "5"),
        ("5;", "5"),
        ("5。", "5"),
        ("5 .", "5"),
        ("5 ;.", "5"),
        ("5 $", "5"),
        (r"\text{5.50}", "5.50"),
        (r"\textbf{5.50}", "5.50"),
        (r"\textrm{5.50}", "5.50"),
        (r"\mathrm{5.50}", "5.50"),
        (r"\mathbf{5.50}", "5.50"),
        (r"\mbox{5.50}", "5.50"),
        (r"\text{-5.50}", "-5.50"),
        (r"\text{+5}", "+5"),
        (r"\text{.5}", ".5"),
        (r"\text{5.}", "5"),
        (r"\text{1,000}", "1,000"),
        (r"\text{1,000,}", "1,000"),
        (r"\text{ 5.50 }", "5.50"),
        (r"\text{5.50\%}", "5.50"),
        (r"\text{5.50%}", "5.50"),
        (r"\text{5.50 \%}", "5.50"),
        (r"\text{\$5.50}", "5.50"),
        (r"\text{\$ 5.50}", "5.50"),
        (r"\$\text{5.50}", "5.50"),
        (r"$ \text{5.50} $", "5.50"),
        (r"$\text{5.50}$.", "5.50"),
        (r"\text{5.50}.", "5.50"),
        (r"**\text{5}**", "5"),
        # not a lone number in one command: left as written
        (r"\text{3}\sqrt{2}", r"\text{3}\sqrt{2}"),
        (r"2\text{3}", r"2\text{3}"),
        (r"\text{5.50 dollars}", r"\text{5.50 dollars}"),
        (r"\text{5-3}", r"\text{5-3}"),
        (r"\text{x}", r"\text{x}"),
        (r"\text{}", r"\text{}"),
        (r"\texttt{5}", r"\texttt{5}"),
        (r"\text{5}\text{6}", r"\text{5}\text{6}"),
        (r"\text{,5}", r"\text{,5}"),
        (r"\text{5..5}", r"\text{5..5}"),
        (r"\text{1.2.3}", r"\text{1.2.3}"),
        (r"\text{--5}", r"\text{--5}"),
    ],
)
def test_clean_answer(answer, cleaned):
    assert clean_answer(answer) == cleaned


def test_math500_reference_solutions_are_correct_in_both_modes(shared_data):
    rows = [json.loads(line) for line in (shared_data / "math500.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 500
    solutions, golds = [r["solution"] for r in rows], [r["answer"] for r in rows]
    for mode in ("strict", "lenient"):
        out = compute_scores_batch(None, solutions, golds, num_workers=2, extraction=mode, timeout_s=10)
        wrong = [(rows[i]["id"], o) for i, o in enumerate(out) if not o["acc"]]
        assert wrong == [], (mode, len(wrong), wrong[:3])


# ---------------------------------------------------------------------------------------- environment

SECRETS = {"WANDB_API_KEY": "wandb-secret", "HF_TOKEN": "hf-secret", "MY_SECRET": "mine", "db_password": "pw",
           "RAY_AUTH_TOKEN_PATH": "/run/ray/token", "GOOGLE_APPLICATION_CREDENTIALS": "/k.json"}  # fmt: skip


def _environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (Linux ``/proc``)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [item.decode().partition("=") for item in f.read().split(b"\0") if item]
    return {name: value for name, _, value in items}


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc/<pid>/environ")
def test_grading_workers_start_without_the_parents_secrets(monkeypatch):
    """A worker grades text the policy wrote: it gets no credential of the parent's (W&B, Hugging Face, Ray's token
    path, anything named like a key, token, secret or password), keeps the rest, and the parent keeps them all."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GTPO_KEEP_ME", "kept")
    before = dict(os.environ)
    pool = GraderPool(max_workers=1)
    try:
        assert pool.grade("5", "5", timeout_s=30) == (True, "ok")
        env = _environ(pool.worker_pids()[0])
    finally:
        pool.shutdown()
    assert sorted(set(SECRETS) & set(env)) == [] and not any(v in env.values() for v in SECRETS.values())
    assert env["PATH"] == os.environ["PATH"] and env["GTPO_KEEP_ME"] == "kept" and env["OMP_NUM_THREADS"] == "1"
    assert env["GTPO_GRADER_PARENT"] == str(os.getpid())
    assert dict(os.environ) == before


# ---------------------------------------------------------------------------------------- memory ceiling

# A 130,000-term sum: the worker's resident memory climbs past 250 MB while it is parsed (measured: lenient
# mode peaks at ~255 MB in ~1 s; answer mode passes 400 MB before a 30 s limit), from ~65 MB at rest.
BIG_SUM = "+".join(["1"] * 130_000)


def test_worker_over_the_memory_ceiling_is_killed_and_replaced():
    pool = GraderPool(max_workers=1, memory_limit_mb=160)
    try:
        assert pool.grade("5", "5", timeout_s=30) == (True, "ok")
        pid = pool.worker_pids()[0]
        # no soft alarm and a long hard limit: only the ceiling can end this call early
        assert pool.grade("7", BIG_SUM, timeout_s=60, soft_timeout_s=0) == (False, "memory")
        assert pool.n_over_memory == 1 and pool.n_killed == 1
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert pool.grade("5", "5", timeout_s=30) == (True, "ok")
        assert pool.worker_pids() != [pid]
        assert pool.grade_response("7", BIG_SUM, timeout_s=60, soft_timeout_s=0) == (False, "memory", "")
        assert pool.n_over_memory == 2
    finally:
        pool.shutdown()


def test_memory_status_reaches_the_reward_without_an_exception(monkeypatch):
    from gtpo.reward.pool import shutdown_pool

    shutdown_pool()
    monkeypatch.setenv("GTPO_REWARD_MEMORY_MB", "160")
    try:
        out = compute_score("m", BIG_SUM, "7", extraction="lenient", timeout_s=60)
        assert (out["acc"], out["grade_status"], out["score"]) == (False, "memory", -1.0)
        assert get_pool().memory_limit_bytes == 160 * 2**20
        assert compute_score("m", r"\boxed{7}", "7")["acc"] is True  # the replacement worker grades on
    finally:
        shutdown_pool()
    monkeypatch.delenv("GTPO_REWARD_MEMORY_MB")
    assert get_pool().memory_limit_bytes == 1024 * 2**20
    with pytest.raises(ValueError, match="memory_limit_mb=-1"):
        GraderPool(memory_limit_mb=-1)


# ---------------------------------------------------------------------------------------------------------------------
# odd inputs at the grader's edges


def test_a_response_longer_than_the_limit_is_graded_on_its_tail_in_both_modes():
    from gtpo.reward.extract import MAX_RESPONSE_CHARS

    response = "x " * MAX_RESPONSE_CHARS + r"so the answer is \boxed{42}"
    for mode in ("strict", "lenient"):
        out = compute_score("math", response, "42", extraction=mode, timeout_s=6)
        assert (out["acc"], out["pred"]) == (True, "42"), (mode, out)
    # the answer only before the tail: nothing to grade, in either mode
    early = r"\boxed{42} " + "x " * MAX_RESPONSE_CHARS
    for mode in ("strict", "lenient"):
        assert compute_score("math", early, "42", extraction=mode, timeout_s=6)["acc"] is False, mode


def test_a_gold_of_exactly_the_answer_limit_is_graded():
    from gtpo.reward.extract import MAX_ANSWER_CHARS

    gold = "1" * MAX_ANSWER_CHARS
    for mode in ("strict", "lenient"):
        assert compute_score("math", rf"\boxed{{{gold}}}", gold, extraction=mode, timeout_s=6)["acc"] is True, mode
        wrong = "2" + gold[1:]
        assert compute_score("math", rf"\boxed{{{wrong}}}", gold, extraction=mode, timeout_s=6)["acc"] is False, mode


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_an_empty_gold_beside_a_real_one_is_skipped_not_matched(mode):
    assert compute_score("math", r"\boxed{7}", ["", "7"], extraction=mode, timeout_s=6)["acc"] is True
    assert compute_score("math", r"\boxed{7}", ["7", ""], extraction=mode, timeout_s=6)["acc"] is True
    assert compute_score("math", r"\boxed{8}", ["", "7"], extraction=mode, timeout_s=6)["acc"] is False
    assert compute_score("math", "", ["", "7"], extraction=mode, timeout_s=6)["acc"] is False


@pytest.mark.parametrize("mode", ["strict", "lenient"])
def test_a_boxed_gold_is_graded_by_its_content(mode):
    assert compute_score("math", r"\boxed{50}", r"\boxed{50\%}", extraction=mode, timeout_s=6)["acc"] is True
    assert compute_score("math", r"\boxed{51}", r"\boxed{50\%}", extraction=mode, timeout_s=6)["acc"] is False


@pytest.mark.parametrize("transient", ["timeout", "busy", "memory"])
@pytest.mark.parametrize("lenient", [False, True])
def test_a_transient_failure_is_never_cached_as_a_verdict(transient, lenient, monkeypatch):
    """Under load one timeout (or a busy pool) must not turn into a permanent wrong reward for the same pair."""
    from gtpo.reward import math as reward_math

    monkeypatch.setattr(reward_math, "_CACHE", {})
    answers = iter([(False, transient), (True, "ok")])
    calls = []

    def grade(gold, text, seconds):
        calls.append((gold, text))
        verdict = next(answers)
        return (*verdict, text) if lenient else verdict

    first = reward_math._grade_any(grade, ["5"], "5", lenient=lenient)
    assert first[:2] == (False, transient)
    second = reward_math._grade_any(grade, ["5"], "5", lenient=lenient)
    assert second[:2] == (True, "ok") and len(calls) == 2
    # a real verdict is cached: the third call does not grade again
    assert reward_math._grade_any(grade, ["5"], "5", lenient=lenient)[:2] == (True, "ok") and len(calls) == 2


def test_the_grading_worker_imports_this_package_before_any_other_on_the_path():
    """A ``gtpo`` on the parent's ``PYTHONPATH`` (another checkout) must not run as the grader."""
    from pathlib import Path

    from gtpo.reward.pool import worker_env

    env = worker_env({"PYTHONPATH": "/elsewhere/with/another/gtpo"}, 1)
    package_parent = str(Path(__file__).resolve().parents[1])
    assert env["PYTHONPATH"].split(os.pathsep) == [package_parent, "/elsewhere/with/another/gtpo"]
