"""In-process equivalence check of an extracted answer against a gold answer with math-verify 0.9.0.

Both sides are wrapped in ``\\boxed{...}`` and parsed with ``LatexExtractionConfig`` (parsing a raw gold fails
for ~20% of MATH-500 answers), then compared with ``math_verify.verify(gold, pred)`` (gold first: not symmetric).

math-verify bounds its own work with ``signal.alarm`` (integer seconds), which only works on the main thread of a
process and only fires between Python bytecodes. ``grade_pair`` therefore is meant to run on the main thread of a
grading worker process (``gtpo.reward.pool``), where a hard wall-clock kill backs the soft alarms up. Called from
another thread it runs without alarms (unbounded) rather than raising.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["grade_pair", "silence_math_verify"]

_GOLD_CACHE: dict[str, list] = {}
_GOLD_CACHE_MAX = 4096


def silence_math_verify() -> None:
    """Mute math-verify / latex2sympy logging (it logs every timeout and parse failure at WARNING)."""
    names = ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.utils", "latex2sympy2_extended")
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _parse(text: str, timeout: int | None):
    from math_verify import LatexExtractionConfig, parse

    return parse("\\boxed{" + text + "}", extraction_config=(LatexExtractionConfig(),), parsing_timeout=timeout)


def grade_pair(gold: str, pred: str, parse_timeout: int = 3, verify_timeout: int = 3) -> tuple[bool, str]:
    """Is ``pred`` equivalent to ``gold``?

    Args:
        gold: ground-truth answer (LaTeX, without ``\\boxed``).
        pred: extracted model answer (LaTeX, without ``\\boxed``).
        parse_timeout, verify_timeout: math-verify's integer SIGALRM limits in seconds (main thread only).

    Returns:
        (acc, status): status ``ok`` (verdict reached), ``timeout`` (a soft alarm fired), ``parse_error``
        (incorrect, and the prediction parsed to no math object: only math-verify's raw-string fallback, which
        still matches an identical string gold) or ``gold_error`` (the gold does not parse).
    """
    silence_math_verify()
    if threading.current_thread() is not threading.main_thread():
        # alarms are unavailable off the main thread; math-verify would raise ValueError
        parse_timeout = verify_timeout = None
    t0 = time.monotonic()
    gold_parsed = _GOLD_CACHE.get(gold)
    if gold_parsed is None:
        gold_parsed = _parse(gold, parse_timeout)
        if not gold_parsed:
            slow = parse_timeout and time.monotonic() - t0 >= parse_timeout - 0.05
            return False, "timeout" if slow else "gold_error"
        if len(_GOLD_CACHE) >= _GOLD_CACHE_MAX:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[gold] = gold_parsed
    from math_verify import verify

    t1 = time.monotonic()
    pred_parsed = _parse(pred, parse_timeout)
    if not pred_parsed:
        slow = parse_timeout and time.monotonic() - t1 >= parse_timeout - 0.05
        return False, "timeout" if slow else "parse_error"
    t2 = time.monotonic()
    ok = bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))
    if not ok and verify_timeout and time.monotonic() - t2 >= verify_timeout - 0.05:
        return False, "timeout"
    if not ok and all(isinstance(p, str) for p in pred_parsed):
        # only math-verify's raw-string fallback survived: the answer is not valid math
        return False, "parse_error"
    return ok, "ok"
