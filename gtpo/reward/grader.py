"""In-process equivalence check of a model answer against a gold answer with math-verify 0.9.0.

``grade_pair`` (strict extraction, the answer already extracted by ``gtpo.reward.extract``): both sides are
wrapped in ``\\boxed{...}`` and parsed with ``LatexExtractionConfig`` (parsing a raw gold fails for ~20% of
MATH-500 answers), then compared with ``math_verify.verify(gold, pred)`` (gold first: not symmetric).

``grade_response`` (lenient extraction, once the strict answer is not graded correct): the whole response goes
through math-verify's own default extraction, ``parse(response, [LatexExtractionConfig(), ExprExtractionConfig()])``:
``\\boxed`` first (several boxes become one set, so ``\\boxed{2}`` and ``\\boxed{3}`` match the gold ``2, 3``),
then "final answer is" / "answer:" lines, then the last LaTeX or plain expression of the text. The gold is parsed
as in ``grade_pair``.

math-verify bounds its own work with ``signal.alarm`` (integer seconds), which only works on the main thread of a
process and only fires between Python bytecodes. Both functions are therefore meant to run on the main thread of
a grading worker process (``gtpo.reward.pool``), where a hard wall-clock kill backs the soft alarms up. Called
from another thread they run without alarms (unbounded) rather than raising.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["grade_pair", "grade_response", "silence_math_verify"]

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


def _alarm_timeouts(parse_timeout, verify_timeout):
    silence_math_verify()
    if threading.current_thread() is not threading.main_thread():
        # alarms are unavailable off the main thread; math-verify would raise ValueError
        return None, None
    return parse_timeout, verify_timeout


def _parsed_gold(gold: str, parse_timeout: int | None) -> tuple[list | None, str]:
    """math-verify's parse of the boxed gold (cached) and ``ok``, or None and ``timeout`` / ``gold_error``."""
    t0 = time.monotonic()
    gold_parsed = _GOLD_CACHE.get(gold)
    if gold_parsed is None:
        gold_parsed = _parse(gold, parse_timeout)
        if not gold_parsed:
            slow = parse_timeout and time.monotonic() - t0 >= parse_timeout - 0.05
            return None, "timeout" if slow else "gold_error"
        if len(_GOLD_CACHE) >= _GOLD_CACHE_MAX:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[gold] = gold_parsed
    return gold_parsed, "ok"


def _verify(gold_parsed: list, pred_parsed: list, verify_timeout: int | None) -> tuple[bool, str]:
    from math_verify import verify

    t0 = time.monotonic()
    ok = bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))
    if not ok and verify_timeout and time.monotonic() - t0 >= verify_timeout - 0.05:
        return False, "timeout"
    if not ok and all(isinstance(p, str) for p in pred_parsed):
        # only math-verify's raw-string fallback survived: the answer is not valid math
        return False, "parse_error"
    return ok, "ok"


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
    parse_timeout, verify_timeout = _alarm_timeouts(parse_timeout, verify_timeout)
    gold_parsed, status = _parsed_gold(gold, parse_timeout)
    if gold_parsed is None:
        return False, status
    t0 = time.monotonic()
    pred_parsed = _parse(pred, parse_timeout)
    if not pred_parsed:
        slow = parse_timeout and time.monotonic() - t0 >= parse_timeout - 0.05
        return False, "timeout" if slow else "parse_error"
    return _verify(gold_parsed, pred_parsed, verify_timeout)


def grade_response(gold: str, response: str, parse_timeout: int = 3, verify_timeout: int = 3) -> tuple[bool, str, str]:
    """Is the answer math-verify extracts from the whole ``response`` equivalent to ``gold``? (lenient mode)

    Returns:
        (acc, status, pred): statuses as :func:`grade_pair`, plus ``no_answer`` (nothing extractable); ``pred`` is
        the matched text of the extracted answer (``""`` if none).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    parse_timeout, verify_timeout = _alarm_timeouts(parse_timeout, verify_timeout)
    gold_parsed, status = _parsed_gold(gold, parse_timeout)
    if gold_parsed is None:
        return False, status, ""
    t0 = time.monotonic()
    config = (LatexExtractionConfig(), ExprExtractionConfig())
    pred_parsed = parse(response, extraction_config=config, parsing_timeout=parse_timeout)
    if not pred_parsed:
        slow = parse_timeout and time.monotonic() - t0 >= parse_timeout - 0.05
        return False, "timeout" if slow else "no_answer", ""
    # with math-verify's default fallback_mode the matched text comes last
    pred = pred_parsed[-1] if isinstance(pred_parsed[-1], str) else str(pred_parsed[0])
    acc, status = _verify(gold_parsed, pred_parsed, verify_timeout)
    return acc, status, pred
