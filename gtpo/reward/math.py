"""Rule-based math reward for verl: strict or lenient answer extraction, math-verify equivalence, hard limits.

Entry points (verl's custom-reward signature ``fn(data_source, solution_str, ground_truth, extra_info=None,
**kwargs)``; verl merges ``reward.custom_reward_function.reward_kwargs`` into ``kwargs``):

* ``compute_score``         sync; thread-safe; what verl's reward-loop managers (naive, dapo, remote) call from
  executor threads of async Ray actors.
* ``compute_score_async``   the same as a coroutine (verl awaits coroutine functions directly in naive/dapo).
* ``compute_scores_batch``  many responses graded in parallel on all cores (offline evaluation, benchmarks; the
  argument names match verl's legacy ``BatchRewardManager``).
* ``compute_score_inline``  grades in the calling process (main thread only, no hard limit): benchmarks/debugging.

Result (same keys on every call, JSON/numpy friendly): ``score`` (float; +1/-1 by default as in DAPO, 1/0 with
``score_mode="binary"``), ``acc`` (bool), ``pred`` (extracted answer string, ``""`` if none; verl's maj@k votes on
it) and ``grade_status``: ``ok`` (verdict reached), ``no_answer`` (no box / Answer line), ``too_long`` (answer or
gold over ``MAX_ANSWER_CHARS``), ``unclosed`` (last box never closes), ``parse_error`` (answer does not parse),
``gold_error`` (gold does not parse), ``timeout`` (hard or soft time limit hit), ``busy`` (no worker free in time),
``error`` (worker crashed), ``memory`` (the grading worker went over its memory ceiling and was replaced).
Everything but ``ok``-and-equivalent scores as incorrect. Grading never raises and never hangs: a response's
grading ends within ``timeout_s`` (default 10 s) of reaching a worker, whatever its number of golds (each gold's
call gets what is left; once it is spent the verdict is ``timeout``), in a worker process with a memory ceiling
(see ``gtpo.reward.pool``).

Extraction (``extraction=...``):

* ``"strict"`` (default, for training: format discipline, DAPO's convention): only the last ``\\boxed{}`` or the
  last DAPO ``Answer:`` line counts (``gtpo.reward.extract``); a response without either is ``no_answer``.
* ``"lenient"`` (for evaluation; ``python -m gtpo.eval`` uses it by default): the strict answer first, and when it
  is not graded correct, math-verify's own default extraction on the whole response
  (``gtpo.reward.grader.grade_response``): ``\\boxed`` first, with every box considered (``\\boxed{2}`` and
  ``\\boxed{3}`` form the set that matches the gold ``2, 3``), then "final answer is ..." / "answer: ..." lines,
  then the last LaTeX or plain expression. So lenient never scores wrong what strict scores right: math-verify's
  extraction alone does on some of strict's answers (``\\boxed{50\\%}`` parses to no number there, while strict
  strips the percent sign; ``Answer: \\$50`` matches none of its patterns). ``pred`` is the strict answer when that
  decided, else math-verify's matched text. Same pool, same memory ceiling, same never-raises guarantee; a lenient
  call makes at most two worker calls per gold (the strict answer, then the response), all within ``timeout_s``.

Options (kwargs, i.e. ``reward_kwargs``; ``score_mode`` may also come per row from ``extra_info["score_mode"]``):
``score_mode`` ("pm1" | "binary"), ``extraction`` ("strict" | "lenient"), ``timeout_s`` (float seconds per response),
``num_workers`` (pool size at first use; env ``GTPO_REWARD_WORKERS``); the memory ceiling per worker comes from
env ``GTPO_REWARD_MEMORY_MB``. Unknown kwargs (e.g. verl's ``reward_router_address``) are ignored.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from gtpo.reward.extract import MAX_ANSWER_CHARS, MAX_RESPONSE_CHARS, clean_answer, extract_answer
from gtpo.reward.pool import get_pool

__all__ = [
    "EXTRACTIONS",
    "GRADE_STATUSES",
    "RESULT_KEYS",
    "compute_score",
    "compute_score_async",
    "compute_score_inline",
    "compute_scores_batch",
]

RESULT_KEYS = ("score", "acc", "pred", "grade_status")
GRADE_STATUSES = (
    "ok",
    "no_answer",
    "too_long",
    "unclosed",
    "parse_error",
    "gold_error",
    "timeout",
    "busy",
    "error",
    "memory",
)
EXTRACTIONS = ("strict", "lenient")
_SCORES = {"pm1": (1.0, -1.0), "binary": (1.0, 0.0)}
DEFAULT_TIMEOUT_S = float(os.environ.get("GTPO_REWARD_TIMEOUT_S", "10"))

# verdicts are a pure function of (gold, pred): cache them, except time-dependent outcomes
_CACHE: dict[tuple[str, str], tuple[bool, str]] = {}
_CACHE_MAX = 65_536
_CACHE_LOCK = threading.Lock()
_CACHEABLE = frozenset({"ok", "parse_error", "gold_error"})


def _resolve_mode(extra_info: Any, kwargs: dict) -> tuple[float, float]:
    mode = kwargs.get("score_mode")
    if mode is None and isinstance(extra_info, dict):
        mode = extra_info.get("score_mode")
    mode = mode or "pm1"
    if mode not in _SCORES:
        raise ValueError(f"score_mode={mode!r}: expected one of {sorted(_SCORES)}")
    return _SCORES[mode]


def _resolve_extraction(kwargs: dict) -> str:
    extraction = kwargs.get("extraction") or "strict"
    if extraction not in EXTRACTIONS:
        raise ValueError(f"extraction={extraction!r}: expected one of {list(EXTRACTIONS)}")
    return extraction


def _resolve_timeout(kwargs: dict) -> float:
    timeout_s = float(kwargs.get("timeout_s") or DEFAULT_TIMEOUT_S)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}: must be > 0")
    return timeout_s


def _as_text(x: Any) -> str:
    if x is None:
        return ""
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return x if isinstance(x, str) else str(x)


def _golds(ground_truth: Any) -> list[str]:
    """Gold answers as strings; a list/array of golds means "any of these". A pre-boxed gold is unwrapped and
    golds get the same clean-up as predictions (``50\\%`` -> ``50``)."""
    if hasattr(ground_truth, "tolist"):
        ground_truth = ground_truth.tolist()
    items = list(ground_truth) if isinstance(ground_truth, list | tuple) else [ground_truth]
    golds = []
    for g in items:
        s = _as_text(g).strip()
        if "\\boxed" in s or "\\fbox" in s:
            ans, status = extract_answer(s)
            s = ans if status == "ok" and ans else s
        golds.append(clean_answer(s))
    return golds


def _result(acc: bool, pred: str | None, status: str, scores: tuple[float, float]) -> dict:
    return {"score": scores[0] if acc else scores[1], "acc": bool(acc), "pred": pred or "", "grade_status": status}


def _check_golds(golds: list[str]) -> str:
    if any(len(g) > MAX_ANSWER_CHARS for g in golds):
        return "too_long"
    return "ok" if any(golds) else "gold_error"


def _prepare(solution_str: Any, ground_truth: Any) -> tuple[str | None, str, list[str]]:
    """Strict mode: the extracted answer, its status and the golds."""
    pred, status = extract_answer(_as_text(solution_str))
    golds = _golds(ground_truth)
    if status == "ok":
        status = _check_golds(golds)
    return pred, status, golds


def _prepare_lenient(solution_str: Any, ground_truth: Any) -> tuple[str, str, list[str]]:
    """Lenient mode: the response tail (the same ``MAX_RESPONSE_CHARS`` as strict), its status and the golds."""
    text = _as_text(solution_str)[-MAX_RESPONSE_CHARS:]
    golds = _golds(ground_truth)
    status = _check_golds(golds) if text.strip() else "no_answer"
    return text, status, golds


def _grade_cached(grade_fn, gold: str, text: str, key: tuple, deadline: float | None, lenient: bool) -> tuple:
    """``grade_fn(gold, text, seconds)`` or its cached verdict; ``seconds`` is what is left of the response's budget
    (``deadline``, a ``time.monotonic()``; None: no bound here). Nothing left: a ``timeout`` verdict, no call."""
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    seconds = None if deadline is None else deadline - time.monotonic()
    if seconds is not None and seconds <= 0:
        return (False, "timeout", "") if lenient else (False, "timeout")
    verdict = grade_fn(gold, text, seconds)
    if verdict[1] in _CACHEABLE:
        with _CACHE_LOCK:
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.clear()
            _CACHE[key] = verdict
    return verdict


def _grade_any(grade_fn, golds: list[str], text: str, lenient: bool = False, deadline: float | None = None) -> tuple:
    """``(True, "ok", ...)`` if ``text`` matches any gold; the verdict of the last attempt otherwise.

    ``grade_fn(gold, text, seconds)`` returns ``(acc, status)`` (strict: ``text`` is the extracted answer) or ``(acc,
    status, pred)`` (lenient: ``text`` is the response, keyed in the cache by its digest). Every gold shares the
    response's ``deadline``: once it has passed the verdict is ``timeout`` and no further gold is tried.
    """
    verdict: tuple = (False, "gold_error", "") if lenient else (False, "gold_error")
    digest = hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=16).digest() if lenient else None
    for gold in golds:
        if not gold:
            continue
        key = (gold, "lenient", digest) if lenient else (gold, text)
        verdict = _grade_cached(grade_fn, gold, text, key, deadline, lenient)
        if verdict[0]:
            return (True, "ok", *verdict[2:])
        if verdict[1] == "timeout" and deadline is not None:
            break  # the call had what was left of the response's time
    return verdict


def _score_one(
    solution_str: Any, ground_truth: Any, scores, extraction: str, grade_answer, grade_response,
    budget_s: float | None = None,
) -> dict:  # fmt: skip
    """One result dict; ``grade_answer(gold, pred, seconds)`` / ``grade_response(gold, response, seconds)`` grade a
    pair. ``budget_s`` bounds the whole response: every gold, the strict and the lenient pass together.

    Lenient grading starts with the strict verdict, so it is never worse than strict on any response.
    """
    deadline = None if budget_s is None else time.monotonic() + budget_s
    pred, status, golds = _prepare(solution_str, ground_truth)
    acc = False
    if status == "ok":
        acc, status = _grade_any(grade_answer, golds, pred, deadline=deadline)
    if extraction == "strict" or acc:
        return _result(acc, pred, status, scores)
    text, status, golds = _prepare_lenient(solution_str, ground_truth)
    if status != "ok":
        return _result(False, None, status, scores)
    acc, status, pred = _grade_any(grade_response, golds, text, lenient=True, deadline=deadline)
    return _result(acc, pred, status, scores)


def _pool_graders(pool) -> tuple:
    """The pool's two grading calls as ``(gold, text, seconds)`` functions."""

    def grade_answer(gold: str, pred: str, seconds: float) -> tuple:
        return pool.grade(gold, pred, timeout_s=seconds)

    def grade_response(gold: str, response: str, seconds: float) -> tuple:
        return pool.grade_response(gold, response, timeout_s=seconds)

    return grade_answer, grade_response


def compute_score(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict:
    """Score one response (verl custom-reward signature). Never raises on bad inputs; bounded time.

    Raises:
        ValueError: only for invalid options (``score_mode``, ``extraction``, ``timeout_s``), i.e. configuration
            errors.
    """
    scores = _resolve_mode(extra_info, kwargs)
    extraction = _resolve_extraction(kwargs)
    timeout_s = _resolve_timeout(kwargs)
    try:
        pool = get_pool(kwargs.get("num_workers"))
        return _score_one(solution_str, ground_truth, scores, extraction, *_pool_graders(pool), timeout_s)
    except Exception:  # noqa: BLE001 - a reward must never take the training step down
        return _result(False, None, "error", scores)


_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_PID: int | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR, _EXECUTOR_PID
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None or _EXECUTOR_PID != os.getpid():
            # threads only wait on worker pipes; enough of them to keep every worker busy
            _EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="gtpo-reward")
            _EXECUTOR_PID = os.getpid()
        return _EXECUTOR


async def compute_score_async(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict:
    """Coroutine form of ``compute_score``: the event loop is never blocked while grading."""
    loop = asyncio.get_running_loop()
    fn = partial(compute_score, data_source, solution_str, ground_truth, extra_info, **kwargs)
    return await loop.run_in_executor(_executor(), fn)


def compute_score_inline(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict:
    """``compute_score`` graded in this process (no worker, no hard limit; soft alarms on the main thread only).

    Meant for single-process benchmarks and debugging, not for reward workers.
    """
    from gtpo.reward.grader import grade_pair, grade_response

    scores = _resolve_mode(extra_info, kwargs)
    extraction = _resolve_extraction(kwargs)
    soft = max(1, int(_resolve_timeout(kwargs) // 3))
    try:
        return _score_one(
            solution_str,
            ground_truth,
            scores,
            extraction,
            lambda gold, pred, _: grade_pair(gold, pred, parse_timeout=soft, verify_timeout=soft),
            lambda gold, text, _: grade_response(gold, text, parse_timeout=soft, verify_timeout=soft),
        )
    except Exception:  # noqa: BLE001
        return _result(False, None, "error", scores)


def compute_scores_batch(
    data_sources: list[str] | None,
    solution_strs: list[str],
    ground_truths: list[Any],
    extra_infos: list[dict | None] | None = None,
    num_workers: int | None = None,
    progress: bool = False,
    **kwargs: Any,
) -> list[dict]:
    """Score many responses in parallel (one worker process per core by default); same dicts as ``compute_score``.

    Args:
        data_sources, solution_strs, ground_truths, extra_infos: equal-length sequences (``data_sources`` and
            ``extra_infos`` may be None).
        num_workers: worker processes (default: all cores); grows the process-wide pool if it is smaller.
        progress: show a tqdm bar.
    """
    n = len(solution_strs)
    if len(ground_truths) != n:
        raise ValueError(f"len(ground_truths)={len(ground_truths)} != len(solution_strs)={n}")
    if data_sources is not None and len(data_sources) != n:
        raise ValueError(f"len(data_sources)={len(data_sources)} != len(solution_strs)={n}")
    if extra_infos is not None and len(extra_infos) != n:
        raise ValueError(f"len(extra_infos)={len(extra_infos)} != len(solution_strs)={n}")
    extra_infos = extra_infos if extra_infos is not None else [None] * n
    all_scores = [_resolve_mode(info, kwargs) for info in extra_infos]
    extraction = _resolve_extraction(kwargs)
    timeout_s = _resolve_timeout(kwargs)
    n_workers = int(num_workers or os.cpu_count() or 1)
    pool = get_pool(n_workers)
    pool.max_workers = max(pool.max_workers, n_workers)

    grade_answer, grade_response = _pool_graders(pool)

    def run(i: int) -> dict:
        try:
            return _score_one(
                solution_strs[i], ground_truths[i], all_scores[i], extraction, grade_answer, grade_response, timeout_s
            )
        except Exception:  # noqa: BLE001
            return _result(False, None, "error", all_scores[i])

    results: list[dict | None] = [None] * n
    with ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="gtpo-grade") as ex:
        futures = {ex.submit(run, i): i for i in range(n)}
        iterator = futures
        if progress:
            from concurrent.futures import as_completed

            from tqdm import tqdm

            iterator = tqdm(as_completed(futures), total=n, desc="grading", unit="resp")
        for fut in iterator:
            results[futures[fut]] = fut.result()
    return results  # type: ignore[return-value]
