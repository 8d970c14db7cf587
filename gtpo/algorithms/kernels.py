"""The estimators' compiled CPU kernels (numba): the code the CPU driver runs for GTPO-token, GRPO-S and GTPO-traj.

Each estimator file (:mod:`gtpo.algorithms.gtpo_token`, :mod:`gtpo.algorithms.grpo_s`, :mod:`gtpo.algorithms.gtpo_traj`)
states its paper's equations as a float64 torch definition and hands CPU tensors to its kernel here, through one line
(:mod:`gtpo.algorithms.kernel_dispatch`); the definition runs on other devices, where numba is missing or a kernel fails
to compile, and is the kernels' test oracle. One file because numba's disk cache keys a compiled function on its own
file: a caller in another file would keep a stale copy of an edited callee.

What each kernel computes is its estimator's definition, in fewer passes:

- GTPO-token (:func:`gtpo_token_kernel`): per polarity q (correct rows: ``v = max(H, 0)``, sign ``s = +1``; incorrect
  rows: ``v = 1/(max(H, 0) + eps)``, ``s = -1``) and weight scope, ``cnt_t`` counts the rows active at position t and
  ``S_t = sum_i v_{i,t}``; then ``c_t = cnt_t / (S_t + eps)`` (Eq. 3 / Eq. 5's count-scaled share:
  ``w_{i,t} = c_t v_{i,t}``) and ``x_{i,t} = a1 b_i + s a2 c_t v_{i,t}`` (r~). Pass 1 (:func:`scan`) accumulates per
  position ``cnt_t``, ``S_t``, ``Q_t = sum v^2``, ``BV_t = sum (b_i - b0) v`` and per row the valid count, the last
  valid column and the raw entropy sum, with the input checks. Eq. 6's set statistics follow in closed form, with
  the shift ``x0 = a1 b0 + s a2`` (so near-constant sets are measured, not cancelled)::

      sum (x - x0)   = a1 sum_i (b_i - b0) n_i + s a2 sum_t (c_t S_t - cnt_t)
      sum (x - x0)^2 = a1^2 sum_i (b_i - b0)^2 n_i + 2 s a1 a2 (sum_t c_t BV_t - sum_i (b_i - b0) n_i)
                       + a2^2 sum_t (c_t^2 Q_t - 2 c_t S_t + cnt_t)

  Pass 2 (:func:`write`) writes ``adv = g_i + k_i c_t v_{i,t}`` (``g_i = (a1 b_i - mean) / (std + eps)``,
  ``k_i = s a2 / (std + eps)`` of the row's set, 0 when it is constant), times the conflict weights of
  ``conflict_mask``. Group scopes visit the rows group by group (:func:`group_sweep`).
- GRPO-S (:func:`grpo_s_kernel`): per row the valid count and the entropy sum (Eq. 8), per group Eq. 9 and the
  normalisation of ``norm_mode`` on ``[B]``, then the advantage broadcast to the valid tokens.
- GTPO-traj (:func:`gtpo_traj_kernel`): per row ``<H>_i``, the conflict runs (:func:`conflict_runs`: position by
  position from the start and from each row's last valid token, a run goes on while its token is shared by a
  positive and a negative completion of the group, and stops at a mask zero), then one write of
  ``A'_i lambda_{i,t} / n_conf_i``.
- :func:`row_sums`: the sequence reward ``sum_t r_{i,t}`` and the lengths, on the kernels' threads.
- Tool tokens inside responses (multi-turn): the GTPO and GTPO-traj kernels raise
  :class:`gtpo.algorithms.gaps.MaskGaps` after their first pass when a row's valid tokens are not one
  block from column 0 and the knobs read another position than the column; the estimator then runs them on its
  position's layout. :func:`mask_has_gaps` is that check alone, for callers without a kernel pass;
  :func:`compact_rows` / :func:`expand_rows` move a row's model tokens to the front and back (``position=model``).

Shared machinery: numba's options and a private disk cache (:func:`jit_options`; a cache folder someone else can
write is code they choose, :mod:`gtpo.private_files`), the compile timer, threads (:func:`run_blocks`: the rows in
blocks on a shared queue, partial sums per worker) and the outputs (:func:`kernel_output`: the memory of freed
outputs kept for the next one, since faulting in fresh pages costs more than the write). Small ``[B]`` arithmetic
runs in numpy, not torch: torch runs even a ``[NG]`` op on its OpenMP pool, whose threads then spin on the cores the
kernel's own threads need.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

from gtpo.algorithms.gaps import MaskGaps
from gtpo.private_files import check_private_dir, private_dir

__all__ = [
    "BadValues",
    "compact_rows",
    "conflict_runs",
    "expand_rows",
    "grpo_s_kernel",
    "gtpo_token_kernel",
    "gtpo_traj_kernel",
    "kernel_output",
    "mask_has_gaps",
    "row_sums",
]


# Shared machinery: options, cache, threads, outputs
# --------------------------------------------------


class BadValues(ValueError):
    """A kernel's pass met a mask value other than 0 / 1, or a non-finite or too negative entropy on a valid token:
    the estimator's own check (:func:`gtpo.algorithms.gtpo_token.check_token_values`) then says which."""


# Options of every njit kernel (:func:`jit_options`): cached on disk, GIL released, numpy's error model (no Python
# division-by-zero check, which would stop LLVM from vectorising the loops) and the fast-math flags that allow
# reordering sums; never 'nnan' / 'ninf', so NaN and inf entropies still propagate into the row sums that detect them.
_JIT_OPTIONS = {
    "cache": True,
    "nogil": True,
    "error_model": "numpy",
    "fastmath": {"reassoc", "contract", "arcp", "nsz"},
}


# Outputs smaller than this come from numpy.empty; larger ones from recycled huge-page-advised memory.
_HUGE_OUTPUT_BYTES = 8 << 20


_WARNED: set[str] = set()


_CACHE_READY = False


def warn_once(key: str, message: str) -> None:
    """A ``RuntimeWarning`` once per process for each ``key``."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)  # a folder made here is this user's alone
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def _private(path: str) -> bool:
    try:
        check_private_dir(path, "numba cache")
        return True
    except OSError:
        return False


def cache_dir_for(candidates: Sequence[str], fallback: str) -> str | None:
    """The ``NUMBA_CACHE_DIR`` to set, or None to leave numba's own choice.

    numba caches in the first writable folder of ``candidates`` (its in-tree ``__pycache__``, then its user-wide
    cache; the first is made here if missing, 0700): None when that one is private. When it is not (another owner,
    group or others may write), or none is writable: ``fallback``, made 0700 if missing; if it exists and is not
    private (planted in advance), a fresh ``tempfile.mkdtemp`` folder, after a warning naming it.
    """
    for path in candidates:
        if _writable(path):
            if _private(path):
                return None
            break  # numba would take this one and load what others put there
    try:
        return str(private_dir(fallback, "numba cache"))
    except OSError as err:
        fresh = tempfile.mkdtemp(prefix=f"{os.path.basename(fallback)}-")
        warn_once("cache", f"numba cache: {err}; compiling into the fresh folder {fresh} instead")
        return fresh


def _ensure_cache_dir() -> None:
    """Point numba's cache at a folder only this user can write (:func:`cache_dir_for`) unless ``NUMBA_CACHE_DIR``
    is set (the user's choice, not checked)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    user = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "numba")
    folder = cache_dir_for([here, user], os.path.join(tempfile.gettempdir(), f"gtpo-numba-cache-{os.getuid()}"))
    if folder is None:
        return
    os.environ["NUMBA_CACHE_DIR"] = folder
    try:  # numba may already have been imported (vLLM imports it): its config is read again by the cache locator
        import numba

        numba.config.CACHE_DIR = folder
    except ImportError:
        pass


def jit_options() -> dict:
    """The options of every ``njit`` kernel; the first call points numba's disk cache at a private folder
    (:func:`_ensure_cache_dir`), before any decorator of a kernel module makes its cache."""
    global _CACHE_READY
    if not _CACHE_READY:
        _ensure_cache_dir()
        _CACHE_READY = True
    return _JIT_OPTIONS


class compile_timer:  # noqa: N801 - used as a context manager, like numba's own timers
    """Seconds spent in numba's compiler (compiling or loading from the disk cache) while the context is open."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> compile_timer:
        from numba.core import event

        def record(seconds: float) -> None:
            self.seconds = float(seconds)

        self._ctx = event.install_timer("numba:compiler_lock", record)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


def num_threads(rows: int) -> int:
    """Threads for a kernel over ``rows`` rows: torch's intra-op thread count, at most one per 64 rows."""
    return max(1, min(torch.get_num_threads(), rows // 64))


def row_shares(rows: int, threads: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges covering ``range(rows)``: one for one thread, else four per thread, which
    the threads take as they come free (a thread the OS deschedules does not hold back the others' rows)."""
    parts = min(1 if threads <= 1 else 4 * threads, max(rows, 1))
    bounds = np.linspace(0, rows, parts + 1).round().astype(np.int64)
    return [(int(bounds[k]), int(bounds[k + 1])) for k in range(parts)]


def run_threads(fn: Callable, jobs: Sequence[tuple]) -> list:
    """``[fn(*job) for job in jobs]`` on up to ``torch.get_num_threads()`` threads (``fn`` releases the GIL)."""
    workers = min(len(jobs), torch.get_num_threads())
    if workers <= 1:
        return [fn(*job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda job: fn(*job), jobs))


def blocks(rows: int, parts: int, tokens: np.ndarray | None = None) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` blocks of rows covering ``range(rows)``, in order.

    With ``tokens`` (``[rows]`` valid counts) the blocks hold about equal numbers of tokens plus a fixed cost per
    row (the mask is read whole); without, equal numbers of rows.
    """
    parts = max(1, min(parts, rows))
    if parts == 1:
        return [(0, rows)]
    if tokens is None:
        bounds = np.linspace(0, rows, parts + 1).round().astype(np.int64)
    else:
        work = np.cumsum(np.asarray(tokens, dtype=np.float64) + 64.0)
        bounds = np.concatenate([[0], np.searchsorted(work, work[-1] * np.arange(1, parts) / parts), [rows]])
    return [(int(bounds[k]), int(bounds[k + 1])) for k in range(parts)]


def run_blocks(fn: Callable, rows: int, threads: int, args: Callable, tokens: np.ndarray | None = None) -> None:
    """``fn(*args(lo, hi, w))`` over every block of :func:`blocks` (four per thread, balanced by ``tokens``).

    ``threads`` workers (the calling thread is worker 0) take the blocks in order from a shared queue, so a worker
    the OS deschedules does not hold back the others' rows; ``w`` is the worker's index, for the partial sums it
    owns (one set per worker, reduced once by the caller, never one per block or per position). ``fn`` releases the
    GIL. An exception in any worker is raised here.
    """
    shares = blocks(rows, 1 if threads <= 1 else 4 * threads, tokens)
    workers = max(1, min(threads, len(shares)))
    queue = iter(shares)
    lock = threading.Lock()

    def work(w: int) -> None:
        while True:
            with lock:
                share = next(queue, None)
            if share is None:
                return
            fn(*args(share[0], share[1], w))

    if workers == 1:
        work(0)
        return
    with ThreadPoolExecutor(max_workers=workers - 1) as pool:
        rest = [pool.submit(work, w) for w in range(1, workers)]
        work(0)
        for f in rest:
            f.result()


class _OutputPool:
    """The memory of freed kernel outputs, kept for the next output of the same size.

    A new ``[B, L]`` output is fresh anonymous memory, and writing it first faults in every page: measured on a
    2-core virtual machine, faulting in huge pages from two threads was slower than from one, so the write pass got
    slower with a second thread (``benchmarks/bench_output_writes.py``). The recipe's trainer frees a step's
    advantages within the step (they go to TransferQueue as a copy), so each estimator call after the first writes
    into memory that is already mapped. A buffer returns here when the last tensor or view of it is freed (a
    finaliser on the array the tensor wraps), so memory in use is never handed out twice. At most :attr:`keep` free
    buffers are held: two, so that a caller which still holds its previous output while asking for the next
    alternates between two buffers instead of mapping a new one each call.
    """

    keep = 2

    def __init__(self) -> None:
        self._free: deque[mmap.mmap] = deque()

    def take(self, nbytes: int) -> mmap.mmap:
        while True:  # a buffer of this size, else a new mapping; free ones of other sizes are dropped as seen
            try:
                buf = self._free.popleft()
            except IndexError:
                return _new_mapping(nbytes)
            if len(buf) == nbytes:
                return buf

    def give_back(self, buf: mmap.mmap) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)

    def clear(self) -> None:
        self._free.clear()


_OUTPUTS = _OutputPool()


def _new_mapping(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP support: ordinary pages
        pass
    return buf


def kernel_output(rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` float32 CPU tensor for a kernel's write pass, which must write every element of it.

    Small outputs come from ``numpy.empty``; larger ones (from 8 MB) are anonymous mappings advised for transparent
    huge pages and recycled through :class:`_OutputPool` once freed, so their contents are whatever the last output
    held.
    """
    nbytes = rows * cols * 4
    if nbytes < _HUGE_OUTPUT_BYTES:  # numpy's allocation: torch.empty of this size is no faster, torch.zeros fills
        return torch.from_numpy(np.empty((rows, cols), dtype=np.float32))
    buf = _OUTPUTS.take(nbytes)
    arr = np.frombuffer(buf, dtype=np.float32).reshape(rows, cols)
    weakref.finalize(arr, _OUTPUTS.give_back, buf)
    return torch.from_numpy(arr)


def as_numpy_mask(mask: torch.Tensor) -> np.ndarray:
    """The mask as a C-contiguous numpy view: bool as uint8, integer and float32 / float64 as they are."""
    mask = mask.detach()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    elif mask.dtype in (torch.float16, torch.bfloat16):
        mask = mask.to(torch.float32)
    return mask.contiguous().numpy()


# Row sums
# --------


@njit(**jit_options())
def _reward_row_sums(values, lo, hi, out):  # pragma: no cover - compiled
    length = values.shape[1]
    for i in range(lo, hi):
        total = 0.0
        for t in range(length):
            total += values[i, t]
        out[i] = total


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """``values.sum(-1)`` of a ``[B, L]`` CPU tensor (float, bool or integer) as ``[B]``: float inputs keep their
    dtype, the others give float64."""
    x = as_numpy_mask(values)
    rows = x.shape[0]
    out = np.zeros(rows, np.float64)
    run_blocks(_reward_row_sums, rows, num_threads(rows), lambda lo, hi, w: (x, lo, hi, out))
    return torch.from_numpy(out).to(values.dtype if values.dtype.is_floating_point else torch.float64)


# Gaps in the mask (multi-turn tool tokens)
# -----------------------------------------


@njit(**jit_options())
def _first_gap_row(mask):  # pragma: no cover - compiled
    """The first row whose valid tokens are not one block from column 0, or -1."""
    length = mask.shape[1]
    for i in range(mask.shape[0]):
        row = mask[i]
        count = 0
        last = -1
        for t in range(length):  # branch-free, so that LLVM vectorises it
            valid = row[t] != 0
            count += valid
            last = max(last, t if valid else -1)
        if count != last + 1:
            return i
    return -1


@njit(**jit_options())
def _compact(values, mask, lo, hi, out):  # pragma: no cover - compiled
    for i in range(lo, hi):
        k = 0
        for t in range(mask.shape[1]):
            if mask[i, t] != 0:
                out[i, k] = values[i, t]
                k += 1


@njit(**jit_options())
def _expand(values, mask, lo, hi, out):  # pragma: no cover - compiled
    for i in range(lo, hi):
        k = 0
        for t in range(mask.shape[1]):
            if mask[i, t] != 0:
                out[i, t] = values[i, k]
                k += 1
            else:
                out[i, t] = 0


def _as_numpy(values: torch.Tensor) -> np.ndarray:
    values = values.detach()
    return (values.view(torch.uint8) if values.dtype == torch.bool else values).contiguous().numpy()


def compact_rows(values: torch.Tensor, mask: torch.Tensor, width: int, fill: float | int = 0) -> torch.Tensor:
    """``[B, L]`` -> ``[B, width]``: each row's values where the mask is non-zero, in order from column 0, ``fill``
    after them (:class:`gtpo.algorithms.token_positions.CompactLayout`)."""
    v, m = _as_numpy(values), as_numpy_mask(mask)
    out = np.full((v.shape[0], width), fill, dtype=v.dtype)
    run_blocks(_compact, v.shape[0], num_threads(v.shape[0]), lambda lo, hi, w: (v, m, lo, hi, out))
    result = torch.from_numpy(out)
    return result.view(torch.bool) if values.dtype == torch.bool else result


def expand_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`compact_rows`: ``[B, W]`` -> the mask's ``[B, L]``, 0 where the mask is 0."""
    v, m = _as_numpy(values), as_numpy_mask(mask)
    out = np.empty(m.shape, dtype=v.dtype)
    run_blocks(_expand, v.shape[0], num_threads(v.shape[0]), lambda lo, hi, w: (v, m, lo, hi, out))
    result = torch.from_numpy(out)
    return result.view(torch.bool) if values.dtype == torch.bool else result


def mask_has_gaps(mask: torch.Tensor) -> bool:
    """Whether a row of the ``[B, L]`` CPU mask has a masked token before its last valid one (tool tokens inside a
    response, :func:`gtpo.algorithms.token_positions.has_gaps`)."""
    return bool(_first_gap_row(as_numpy_mask(mask)) >= 0)


# Conflict runs (GTPO-traj; GTPO-token under conflict_mask)
# ---------------------------------------------------------


@njit(**jit_options())
def _runs(ids, mask, order, group_start, polarity, last, backward, run):
    """Leading (``backward=False``) or trailing run length of raw-conflict tokens of every row, group by group."""
    length = mask.shape[1]
    for j in range(group_start.shape[0] - 1):
        rows = order[group_start[j] : group_start[j + 1]]
        has_pos = False
        has_neg = False
        for i in rows:
            has_pos |= polarity[i] > 0
            has_neg |= polarity[i] < 0
        if not (has_pos and has_neg):
            continue
        size = rows.shape[0]
        alive = np.zeros(size, np.bool_)
        ok = np.zeros(size, np.bool_)
        tok = np.zeros(size, ids.dtype)
        any_alive = False
        for a in range(size):
            alive[a] = polarity[rows[a]] != 0
            any_alive |= alive[a]
        d = 0
        while any_alive:
            # every active row's token at aligned position d (valid only where its mask is 1)
            for a in range(size):
                i = rows[a]
                col = last[i] - d if backward else d
                ok[a] = polarity[i] != 0 and 0 <= col < length and mask[i, col] != 0
                tok[a] = ids[i, col] if ok[a] else 0
            any_alive = False
            for a in range(size):
                if not alive[a]:
                    continue
                shared_pos = False
                shared_neg = False
                if ok[a]:
                    for other in range(size):
                        if ok[other] and tok[other] == tok[a]:
                            if polarity[rows[other]] > 0:
                                shared_pos = True
                            else:
                                shared_neg = True
                if shared_pos and shared_neg:
                    run[rows[a]] += 1
                    any_alive = True
                else:
                    alive[a] = False
            d += 1


def conflict_runs(responses: torch.Tensor, mask: np.ndarray, group_of_row: np.ndarray, num_groups: int,
                  polarity: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Forward and backward conflict-run lengths ``(f [B], b [B])`` int64 (docs/ALGORITHMS.md §6.2).

    Args:
        responses: ``[B, L]`` integer token ids (CPU). mask: ``[B, L]`` numpy mask. group_of_row: ``[B]`` int64
        group ids; num_groups: ``NG``. polarity: ``[B]`` +1 / -1 / 0 (inactive). last: ``[B]`` last valid column
        (-1: empty).
    """
    ids = responses.detach().contiguous().numpy()
    order = np.argsort(group_of_row, kind="stable")
    group_start = np.concatenate([[0], np.cumsum(np.bincount(group_of_row, minlength=num_groups))]).astype(np.int64)
    sign = np.ascontiguousarray(polarity, dtype=np.int8)
    run_fwd = np.zeros(group_of_row.shape[0], np.int64)
    run_bwd = np.zeros(group_of_row.shape[0], np.int64)
    shared = (ids, mask, order, group_start, sign, last)
    run_threads(_runs, [(*shared, False, run_fwd), (*shared, True, run_bwd)])
    return run_fwd, run_bwd


# GTPO-token's compiled passes
# ----------------------------


_ZERO_FILL, _JOINT, _SPLIT = 0, 1, 2


@njit(**jit_options())
def _mask_row(m_row):
    """``(valid count, last valid column or -1, valid values other than 1)`` of one mask row."""
    count = 0
    last = -1
    bad = 0
    for t in range(m_row.shape[0]):  # branch-free, so that LLVM vectorises it
        m = m_row[t]
        valid = m != 0
        count += valid
        bad += valid & (m != 1)
        last = max(last, t if valid else -1)
    return count, last, bad


@njit(**jit_options())
def mask_rows(mask, rows, n_valid, last):
    """:func:`_mask_row` of each row in ``rows`` into ``n_valid`` / ``last``."""
    for i in rows:
        n_valid[i], last[i], _ = _mask_row(mask[i])


@njit(**jit_options())
def _values(h_row, m_row, stop, dense, negative, eps, tol, v):
    """``v_t`` of Eq. 3 (``max(H, 0)``) or Eq. 5 (``1 / (max(H, 0) + eps)``) for ``t < stop`` into ``v`` (0 off mask).

    ``dense``: every column below ``stop`` is valid (the mask is not read). Returns the raw sum of the valid
    entropies (NaN / inf when one is) and how many are below ``-tol``; padding is never read.
    """
    total = 0.0
    low = 0
    if dense and negative:
        for t in range(stop):
            h = h_row[t]
            total += h
            low += h < -tol
            v[t] = 1.0 / (max(h, 0.0) + eps)
    elif dense:
        for t in range(stop):
            h = h_row[t]
            total += h
            low += h < -tol
            v[t] = max(h, 0.0)
    else:
        for t in range(stop):
            valid = m_row[t] != 0
            h = h_row[t] if valid else 0.0
            total += h
            low += h < -tol
            hc = max(h, 0.0)
            v[t] = (1.0 / (hc + eps) if valid else 0.0) if negative else hc
    return total, low


@njit(**jit_options())
def _accumulate(h_row, stop, negative, eps, tol, s_t, q_t, top_v):
    """:func:`_values` of a dense row folded straight into ``S_t``, ``Q_t`` and ``max v`` (no buffer)."""
    total = 0.0
    low = 0
    if negative:
        for t in range(stop):
            h = h_row[t]
            total += h
            low += h < -tol
            x = 1.0 / (max(h, 0.0) + eps)
            s_t[t] += x
            q_t[t] += x * x
            top_v[t] = max(top_v[t], x)
    else:
        for t in range(stop):
            h = h_row[t]
            total += h
            low += h < -tol
            x = max(h, 0.0)
            s_t[t] += x
            q_t[t] += x * x
            top_v[t] = max(top_v[t], x)
    return total, low


@njit(**jit_options())
def scan(entropy, mask, rows, incorrect, base_dev, eps, tol, sums, dense_hist, n_valid, last, entropy_sum, errors):
    """Pass 1 over ``rows``: per position ``sums[q] = (cnt, S, Q, BV, max v)``; per row count, last column, entropy sum.

    ``cnt`` of dense rows (valid exactly on ``[0, n_i)``) goes to ``dense_hist[q, n_i]`` and is expanded by
    :func:`coefficients`. ``errors`` counts non-binary mask values, rows with a non-finite entropy, entropies below
    ``-tol``. Returns the largest last valid column.
    """
    v = np.empty(entropy.shape[1])
    top = -1
    for i in rows:  # the mask first, apart: one stream at a time runs faster than the two interleaved row by row
        count, lst, bad = _mask_row(mask[i])
        n_valid[i] = count
        last[i] = lst
        errors[0] += bad
        top = max(top, lst)
    for i in rows:
        count = n_valid[i]
        lst = last[i]
        q = 1 if incorrect[i] else 0
        dense = count == lst + 1
        e = base_dev[i]
        cnt, s_t, q_t, bv, top_v = sums[q, 0], sums[q, 1], sums[q, 2], sums[q, 3], sums[q, 4]
        if dense and e == 0.0:  # the common row: one loop from the entropy to the sums
            total, low = _accumulate(entropy[i], count, q == 1, eps, tol, s_t, q_t, top_v)
        else:
            total, low = _values(entropy[i], mask[i], lst + 1, dense, q == 1, eps, tol, v)
            for t in range(lst + 1):
                s_t[t] += v[t]
                q_t[t] += v[t] * v[t]
                top_v[t] = max(top_v[t], v[t])
                bv[t] += e * v[t]
        if dense:
            dense_hist[q, count] += 1.0
        else:
            m_row = mask[i]
            for t in range(lst + 1):
                cnt[t] += m_row[t] != 0
        entropy_sum[i] = total
        errors[1] += not np.isfinite(total)
        errors[2] += low
    return top


@njit(**jit_options())
def coefficients(sums, dense_hist, stop, eps, alpha2, coef, out):
    """Dense rows' counts into ``cnt_t``, then ``c_t = cnt_t / (S_t + eps)`` for ``t < stop``.

    ``out`` receives the conservation error ``alpha2 * max_t |c_t S_t - cnt_t|`` (Prop. 2.2 up to the eps guard) and
    each polarity's largest weight ``max_t c_t max_i v_{i,t}``.
    """
    out[0] = 0.0
    for q in range(2):
        active = 0.0
        out[1 + q] = 0.0
        for t in range(stop - 1, -1, -1):
            active += dense_hist[q, t + 1]
            sums[q, 0, t] += active
            coef[q, t] = sums[q, 0, t] / (sums[q, 1, t] + eps)
            out[0] = max(out[0], alpha2 * abs(coef[q, t] * sums[q, 1, t] - sums[q, 0, t]))
            out[1 + q] = max(out[1 + q], coef[q, t] * sums[q, 4, t])


@njit(**jit_options())
def moments(entropy, mask, rows, incorrect, coef, eps, tol, alpha1, alpha2, base, n_valid, last, row_moments):
    """Per row, over its valid tokens with ``w = c_t v_t``: ``row_moments[i] = (sum (w-1), sum (w-1)^2, sum |x|)``."""
    v = np.empty(entropy.shape[1])
    for i in rows:
        lst = last[i]
        dense = n_valid[i] == lst + 1
        q = 1 if incorrect[i] else 0
        s = -1.0 if q else 1.0
        _values(entropy[i], mask[i], lst + 1, dense, q == 1, eps, tol, v)
        coef_q = coef[q]
        ab = alpha1 * base[i]
        d = 0.0
        d2 = 0.0
        ax = 0.0
        m_row = mask[i]
        for t in range(lst + 1):
            valid = dense or m_row[t] != 0
            w = coef_q[t] * v[t]
            dw = w - 1.0 if valid else 0.0
            d += dw
            d2 += dw * dw
            ax += abs(ab + s * alpha2 * w) if valid else 0.0
        row_moments[i, 0] = d
        row_moments[i, 1] = d2
        row_moments[i, 2] = ax


@njit(**jit_options())
def _emit(v, stop, out_row):
    """``out_row[t] = v_t`` for ``t < stop``; returns ``(sum, sum |.|, #> 0, #< 0)`` of what it wrote."""
    total = 0.0
    size = 0.0
    pos = 0
    negs = 0
    for t in range(stop):
        a = v[t]
        out_row[t] = a
        total += a
        size += abs(a)
        pos += a > 0.0
        negs += a < 0.0
    return total, size, pos, negs


@njit(**jit_options())
def _emit_dense(h_row, stop, negative, eps, coef, intercept, slope, out_row):
    """:func:`_values` and :func:`_emit` of a dense row in one loop (no buffer): ``out_row[t] = g + k c_t v_t``."""
    total = 0.0
    size = 0.0
    pos = 0
    negs = 0
    for t in range(stop):  # `negative` is loop-invariant: LLVM unswitches the loop into one per polarity
        hc = max(h_row[t], 0.0)
        a = intercept + slope * coef[t] * (1.0 / (hc + eps) if negative else hc)
        out_row[t] = a
        total += a
        size += abs(a)
        pos += a > 0.0
        negs += a < 0.0
    return total, size, pos, negs


@njit(**jit_options())
def write(entropy, mask, rows, incorrect, coef, eps, tol, intercept, slope, n_valid, last, run_fwd, run_bwd,
          conflict_lam, out, row_stats):  # fmt: skip
    """Pass 2: ``adv = (g_i + k_i c_t v_t) * lambda_{i,t}`` on the valid tokens, 0 on every other position.

    ``lambda`` is ``conflict_lam[i]`` on the first ``run_fwd[i]`` and the last ``run_bwd[i]`` valid columns (the
    conflict runs), 1 elsewhere. ``row_stats[i] = (sum adv, sum |adv|, #adv > 0, #adv < 0)``.
    """
    v = np.empty(entropy.shape[1])
    for i in rows:
        lst = last[i]
        out_row = out[i]
        if lst < 0:  # no valid token
            out_row[:] = 0.0
            continue
        dense = n_valid[i] == lst + 1
        q = 1 if incorrect[i] else 0
        coef_q = coef[q]
        intercept_i = intercept[i]
        slope_i = slope[i]
        if dense and run_fwd[i] == 0 and run_bwd[i] == 0:  # the common row: one loop from the entropy to the output
            total, size, pos, negs = _emit_dense(
                entropy[i], lst + 1, q == 1, eps, coef_q, intercept_i, slope_i, out_row
            )
        else:
            _values(entropy[i], mask[i], lst + 1, dense, q == 1, eps, tol, v)
            for t in range(lst + 1):
                v[t] = intercept_i + slope_i * coef_q[t] * v[t]
            if not dense:
                m_row = mask[i]
                for t in range(lst + 1):
                    v[t] = v[t] if m_row[t] != 0 else 0.0
            for t in range(min(run_fwd[i], lst + 1)):
                v[t] *= conflict_lam[i]
            for t in range(max(lst + 1 - run_bwd[i], 0), lst + 1):
                v[t] *= conflict_lam[i]
            total, size, pos, negs = _emit(v, lst + 1, out_row)
        out_row[lst + 1 :] = 0.0
        row_stats[i, 0] = total
        row_stats[i, 1] = size
        row_stats[i, 2] = pos
        row_stats[i, 3] = negs


@njit(**jit_options())
def set_scales(set_sums, shift, mode, unbiased, rtol, eps, mean, inv):
    """Eq. 6 per polarity q from ``set_sums[q] = (tokens, sum (x - x0), sum (x - x0)^2, sum |x|)`` (``shift = x0``):
    the set's mean and ``1 / (std + eps)`` (0 for a constant set: fewer than two tokens, or
    ``std <= rtol * mean|x|``)."""
    n_valid = np.zeros(2)
    mu = np.zeros(2)
    m2 = np.zeros(2)
    for q in range(2):
        n_valid[q] = set_sums[q, 0]
        if n_valid[q] > 0:
            mu[q] = shift[q] + set_sums[q, 1] / n_valid[q]
            m2[q] = max(set_sums[q, 2] - set_sums[q, 1] * set_sums[q, 1] / n_valid[q], 0.0)
    total = n_valid[0] + n_valid[1]
    for q in range(2):
        if mode == _SPLIT:
            size, centre, spread, absum = n_valid[q], mu[q], m2[q], set_sums[q, 3]
        elif mode == _JOINT:
            size = total
            centre = (n_valid[0] * mu[0] + n_valid[1] * mu[1]) / total if total > 0 else 0.0
            spread = m2[0] + m2[1] + n_valid[0] * (mu[0] - centre) ** 2 + n_valid[1] * (mu[1] - centre) ** 2
            absum = set_sums[0, 3] + set_sums[1, 3]
        else:  # zero_fill: the other polarity's tokens are zeros of this field
            size = total
            centre = n_valid[q] * mu[q] / total if total > 0 else 0.0
            spread = m2[q] + n_valid[q] * (mu[q] - centre) ** 2 + (total - n_valid[q]) * centre * centre
            absum = set_sums[q, 3]
        denom = max(size - 1.0, 1.0) if unbiased else max(size, 1.0)
        std = math.sqrt(spread / denom) if size > 1 else 0.0
        constant = size <= 1 or std <= rtol * absum / size
        mean[q] = centre
        inv[q] = 0.0 if constant else 1.0 / (std + eps)


@njit(**jit_options())
def add_rows(rows, incorrect, n_valid, row_moments, base, first_base, alpha1, alpha2, set_sums):
    """Fold rows into ``set_sums`` (:func:`set_scales`) from their moments; returns nothing."""
    for i in rows:
        q = 1 if incorrect[i] else 0
        s = -1.0 if q else 1.0
        e = base[i] - first_base[q]
        ni = n_valid[i]
        set_sums[q, 0] += ni
        set_sums[q, 1] += alpha1 * e * ni + s * alpha2 * row_moments[i, 0]
        set_sums[q, 2] += (
            alpha1 * alpha1 * e * e * ni
            + 2.0 * s * alpha1 * alpha2 * e * row_moments[i, 0]
            + alpha2 * alpha2 * row_moments[i, 1]
        )
        set_sums[q, 3] += row_moments[i, 2]


@njit(**jit_options())
def row_scales(rows, incorrect, base, alpha1, alpha2, mean, inv, intercept, slope):
    """``g_i = (alpha1 b_i - mean) / (std + eps)`` and ``k_i = s alpha2 / (std + eps)`` of each row's set."""
    for i in rows:
        q = 1 if incorrect[i] else 0
        intercept[i] = (alpha1 * base[i] - mean[q]) * inv[q]
        slope[i] = (-alpha2 if q else alpha2) * inv[q]


@njit(**jit_options())
def group_sweep(entropy, mask, order, group_start, groups, incorrect, base_dev, base, first_base, shift, knobs,
                coef_batch, by_group, stage, n_valid, last, entropy_sum, errors, row_moments, conservation, intercept,
                slope, run_fwd, run_bwd, conflict_lam, out, row_stats):  # fmt: skip
    """The group scopes, for ``groups`` (one thread's share), rows ``order[group_start[j] : group_start[j + 1]]``
    of group j.

    ``knobs = (eps, tol, alpha1, alpha2, mode, unbiased, rtol)``. ``by_group``: weights per group
    (``weight_scope="group"``), else ``coef_batch``. ``stage``: 0 = per-row moments only (the first visit of
    ``norm_scope="batch"``); 1 = Eq. 6 per group, then the advantages; 2 = the advantages with the ``intercept`` /
    ``slope`` already set.
    """
    eps, tol, alpha1, alpha2, mode, unbiased, rtol = knobs
    length = entropy.shape[1]
    sums = np.zeros((2, 5, length))
    dense_hist = np.zeros((2, length + 1))
    coef = np.zeros((2, length)) if by_group else coef_batch
    set_sums = np.zeros((2, 4))
    mean = np.zeros(2)
    inv = np.zeros(2)
    for j in groups:
        rows = order[group_start[j] : group_start[j + 1]]
        if by_group:
            top = scan(
                entropy, mask, rows, incorrect, base_dev, eps, tol, sums, dense_hist, n_valid, last, entropy_sum, errors
            )
            coefficients(sums, dense_hist, top + 1, eps, alpha2, coef, conservation[j])
            sums[:, :, : top + 1] = 0.0
            dense_hist[:] = 0.0
        if stage != 2:
            moments(entropy, mask, rows, incorrect, coef, eps, tol, alpha1, alpha2, base, n_valid, last, row_moments)
        if stage == 1:
            set_sums[:] = 0.0
            add_rows(rows, incorrect, n_valid, row_moments, base, first_base, alpha1, alpha2, set_sums)
            set_scales(set_sums, shift, mode, unbiased, rtol, eps, mean, inv)
            row_scales(rows, incorrect, base, alpha1, alpha2, mean, inv, intercept, slope)
        if stage:
            write(entropy, mask, rows, incorrect, coef, eps, tol, intercept, slope, n_valid, last, run_fwd, run_bwd,
                  conflict_lam, out, row_stats)  # fmt: skip


# GTPO-token's driver
# -------------------


_MODES = {"zero_fill": 0, "joint": 1, "split": 2}


def gtpo_token_kernel(entropy, response_mask, correct, base, gid, num_groups, params, responses=None):
    """GTPO-token advantages and diagnostics on CPU tensors (validated by the caller).

    Args:
        entropy: ``[B, L]`` float entropy. response_mask: ``[B, L]`` 0/1 (bool, integer or float).
        correct: ``[B]`` bool. base: ``[B]`` float64 bases (``shaping_bases``: reward or -1, plus the GROP offset).
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: ``GTPOParams``.
        responses: ``[B, L]`` token ids when ``params.conflict_mask``.

    Returns:
        ``(advantages [B, L] float32, diagnostics)``; ``kernel_compile_s`` is among the diagnostics on a
        call that compiled (or loaded from the disk cache) the kernel.

    Raises:
        BadValues: on bad token values. A numba error when numba cannot compile the kernel (the caller falls back
            to the definition).
    """
    with compile_timer() as timer:
        outputs = _gtpo_token(entropy, response_mask, correct, base, gid, num_groups, params, responses)
    if timer.seconds > 0:
        outputs[-1]["kernel_compile_s"] = timer.seconds
    return outputs


def _gtpo_token(entropy, response_mask, correct, base, gid, num_groups, params, responses):
    bt = _Batch(entropy, response_mask, correct, base, gid, num_groups, params)
    if params.weight_scope == "batch":
        coef, sums, tops = bt.batch_weights()  # pass 1
        bt.refuse_gaps()
        if params.conflict_mask:
            bt.conflict_runs(responses)
        weights = ((coef * sums[:, 1]).sum(-1), (coef * coef * sums[:, 2]).sum(-1), tops[1:], tops[0])
        if params.norm_scope == "batch":
            shaped = bt.closed_form(coef, sums)
            bt.write(coef)  # pass 2
        else:
            shaped, _ = bt.group_scopes(coef, responses)
    else:
        shaped, weights = bt.group_scopes(None, responses)
        bt.refuse_gaps()
    bt.diag.update(_gtpo_diagnostics(params, correct.numpy(), bt.group_of_row, num_groups, bt.n_valid, bt.entropy_sum,
                                bt.row_stats, shaped, *weights))  # fmt: skip
    return bt.out, bt.diag


class _Batch:
    """The numpy views, knobs and per-row arrays of one call (names: the module docstring), and its passes."""

    def __init__(self, entropy, response_mask, correct, base, gid, num_groups, params):
        self.inputs, self.params = (entropy, response_mask), params
        # float32 / float64 entropy is read as it is, other float types as float32
        values = entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()
        self.entropy = values.detach().contiguous().numpy()
        self.mask = as_numpy_mask(response_mask)
        b, length = self.entropy.shape
        self.rows, self.length, self.num_groups = b, length, num_groups
        self.incorrect = (~correct).numpy()
        self.base = base.to(torch.float64).numpy()
        self.group_of_row = gid.to(torch.long).numpy()
        self.eps, self.tol = float(params.eps), float(params.neg_entropy_tol)
        self.alpha1, self.alpha2 = float(params.alpha1), float(params.alpha2)
        self.knobs = (self.eps, self.tol, self.alpha1, self.alpha2, _MODES[params.norm_mode], params.std == "unbiased",
                      float(params.zero_var_rtol))  # fmt: skip
        self.sign = np.where(self.incorrect, -1.0, 1.0)
        # b0: each polarity's first base; x0 = a1 b0 + s a2, its shaped reward when every share is 1
        neg, pos = self.incorrect, ~self.incorrect
        self.first_base = np.array([self.base[pos][0] if pos.any() else 0.0, self.base[neg][0] if neg.any() else 0.0])
        self.shift = self.alpha1 * self.first_base + np.array([self.alpha2, -self.alpha2])
        self.base_dev = self.base - self.first_base[neg.astype(np.int64)]
        self.n_valid, self.last = np.zeros(b, np.int64), np.full(b, -1, np.int64)
        self.entropy_sum, self.row_moments, self.row_stats = np.zeros(b), np.zeros((b, 3)), np.zeros((b, 4))
        self.intercept, self.slope = np.zeros(b), np.zeros(b)
        self.run_fwd, self.run_bwd = np.zeros(b, np.int64), np.zeros(b, np.int64)
        self.conflict_lam = np.where(neg, float(params.conflict_lam_neg), float(params.conflict_lam_pos))
        self.out = kernel_output(b, length)
        self.threads = num_threads(b)
        self.diag: dict[str, float] = {}

    def check(self, errors) -> None:
        """Raise :class:`BadValues` if pass 1 counted a bad mask value or entropy."""
        if errors.any():
            raise BadValues

    def refuse_gaps(self) -> None:
        """Raise :class:`MaskGaps` after pass 1 if a row has a gap and ``position`` is not the column."""
        if self.params.position != "raw" and bool((self.n_valid != self.last + 1).any()):
            raise MaskGaps

    def batch_weights(self):
        """Pass 1 over every row (``weight_scope="batch"``), blocks of rows over the threads, each thread with its
        own partial sums: ``coef [2, L]``, the summed ``sums`` and ``(conservation error, largest weight of each
        polarity)``."""
        length = self.length
        parts = [(np.zeros((2, 5, length)), np.zeros((2, length + 1)), np.zeros(3, np.int64))
                 for _ in range(self.threads)]  # fmt: skip
        run_blocks(scan, self.rows, self.threads, lambda lo, hi, w: (
            self.entropy, self.mask, np.arange(lo, hi), self.incorrect, self.base_dev, self.eps, self.tol,
            *parts[w][:2], self.n_valid, self.last, self.entropy_sum, parts[w][2]))  # fmt: skip
        self.check(sum(errors for _, _, errors in parts))
        sums, dense_hist = parts[0][0], parts[0][1]
        for s, h, _ in parts[1:]:  # the threads' partial sums, reduced once (the per-position maxima by max)
            sums[:, :4] += s[:, :4]
            np.maximum(sums[:, 4], s[:, 4], out=sums[:, 4])
            dense_hist += h
        coef, tops = np.zeros((2, length)), np.zeros(3)
        coefficients(sums, dense_hist, length, self.eps, self.alpha2, coef, tops)
        return coef, sums, tops

    def conflict_runs(self, responses) -> None:
        """``conflict_mask``: GTPO-trajectory's conflict runs with correctness as the polarity (needs ``last``)."""
        polarity = np.where(self.incorrect, -1, 1).astype(np.int8) * (self.n_valid > 0)
        self.run_fwd[:], self.run_bwd[:] = conflict_runs(responses, self.mask, self.group_of_row, self.num_groups,
                                                         polarity, self.last)  # fmt: skip
        overlap = np.maximum(self.run_fwd + self.run_bwd - (self.last + 1), 0)
        conflict = (self.run_fwd + self.run_bwd - overlap).sum()
        self.diag["conflict_token_frac"] = float(conflict) / max(int(self.n_valid.sum()), 1)

    def set_scales(self, set_sums) -> None:
        """Eq. 6 from the polarities' sums ``set_sums``: every row's ``intercept`` / ``slope``."""
        mean, inv = np.zeros(2), np.zeros(2)
        set_scales(set_sums, self.shift, *self.knobs[4:], self.eps, mean, inv)
        row_scales(np.arange(self.rows), self.incorrect, self.base, self.alpha1, self.alpha2, mean, inv,
                   self.intercept, self.slope)  # fmt: skip

    def closed_form(self, coef, sums):
        """Eq. 6 at batch scopes from the per-position sums (module docstring): sets every row's ``intercept`` /
        ``slope``; returns the polarities' sums of shaped rewards."""
        a1, a2, base_dev, n = self.alpha1, self.alpha2, self.base_dev, self.n_valid
        set_sums = np.zeros((2, 4))  # per polarity: tokens, sum (x - x0), sum (x - x0)^2, sum |x|
        for q, s in ((0, 1.0), (1, -1.0)):
            rows = self.incorrect == bool(q)
            e, nq = base_dev[rows], n[rows]
            cnt, s_t, q_t, bv = sums[q, :4]
            c = coef[q]
            set_sums[q, 0] = nq.sum()
            set_sums[q, 1] = a1 * (e * nq).sum() + s * a2 * (c * s_t - cnt).sum()
            set_sums[q, 2] = (a1 * a1 * (e * e * nq).sum() + 2 * s * a1 * a2 * ((c * bv).sum() - (e * nq).sum())
                              + a2 * a2 * (c * c * q_t - 2 * c * s_t + cnt).sum())  # fmt: skip
        shaped = set_sums[:, 0] * self.shift + set_sums[:, 1]
        # mean|x| = s * sum x, except on rows whose base has the other sign than s: there token by token
        set_sums[0, 3], set_sums[1, 3] = shaped[0], -shaped[1]
        mixed = np.nonzero((a1 * self.base * self.sign < 0) & (n > 0))[0]
        if mixed.size:
            moments(self.entropy, self.mask, mixed, self.incorrect, coef, self.eps, self.tol, a1, a2, self.base, n,
                    self.last, self.row_moments)  # fmt: skip
            for q, s in ((0, 1.0), (1, -1.0)):
                rows = mixed[self.incorrect[mixed] == bool(q)]
                x_mixed = (n[rows] * self.shift[q] + a1 * base_dev[rows] * n[rows]
                           + s * a2 * self.row_moments[rows, 0]).sum()  # fmt: skip
                set_sums[q, 3] += self.row_moments[rows, 2].sum() - s * x_mixed
        self.set_scales(set_sums)
        return shaped

    def write(self, coef) -> None:
        """Pass 2 over every row: the advantages into ``out``, the per-row sums into ``row_stats``."""
        out = self.out.numpy()
        run_blocks(write, self.rows, self.threads, lambda lo, hi, w: (
            self.entropy, self.mask, np.arange(lo, hi), self.incorrect, coef, self.eps, self.tol, self.intercept,
            self.slope, self.n_valid, self.last, self.run_fwd, self.run_bwd, self.conflict_lam, out, self.row_stats),
            self.n_valid)  # fmt: skip

    def group_scopes(self, coef_batch, responses):
        """``norm_scope`` or ``weight_scope`` = ``"group"``: the rows group by group (:func:`group_sweep`).

        ``coef_batch``: the batch weights (``weight_scope="batch"``), else None (per-group weights). Returns the
        polarities' sums of shaped rewards and, for per-group weights, the weight diagnostics' sums.
        """
        b, num_groups = self.rows, self.num_groups
        order = np.argsort(self.group_of_row, kind="stable")
        counts = np.bincount(self.group_of_row, minlength=num_groups)
        group_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        by_group = coef_batch is None
        coef_batch = np.zeros((2, self.length)) if by_group else coef_batch
        per_group = np.zeros((num_groups, 3))  # conservation error, largest weight of each polarity
        shares = row_shares(num_groups, self.threads)
        errors = [np.zeros(3, np.int64) for _ in shares]
        out = self.out.numpy()

        def sweep(stage):
            run_threads(group_sweep, [
                (self.entropy, self.mask, order, group_start, np.arange(lo, hi), self.incorrect, self.base_dev,
                 self.base, self.first_base, self.shift, self.knobs, coef_batch, by_group, stage, self.n_valid,
                 self.last, self.entropy_sum, errors[t], self.row_moments, per_group, self.intercept, self.slope,
                 self.run_fwd, self.run_bwd, self.conflict_lam, out, self.row_stats)
                for t, (lo, hi) in enumerate(shares)])  # fmt: skip

        if by_group and self.params.conflict_mask:
            mask_rows(self.mask, np.arange(b), self.n_valid, self.last)  # the conflict runs need each row's last column
            self.conflict_runs(responses)
        if self.params.norm_scope == "batch":
            sweep(0)  # per-group weights, batch statistics: every row's moments before any row is written
            self.check(sum(errors))
            set_sums = np.zeros((2, 4))
            add_rows(np.arange(b), self.incorrect, self.n_valid, self.row_moments, self.base, self.first_base,
                     self.alpha1, self.alpha2, set_sums)  # fmt: skip
            self.set_scales(set_sums)
            sweep(2)
        else:
            sweep(1)
            self.check(sum(errors))
        d, d2, n, neg = self.row_moments[:, 0], self.row_moments[:, 1], self.n_valid, self.incorrect
        rows_x = n * self.shift[neg.astype(np.int64)] + self.alpha1 * self.base_dev * n + self.sign * self.alpha2 * d
        shaped = np.array([rows_x[~neg].sum(), rows_x[neg].sum()])
        w, w2 = d + n, d2 + 2 * d + n  # per row: sum w and sum w^2 from sum (w - 1) and sum (w - 1)^2
        weights = (
            np.array([w[~neg].sum(), w[neg].sum()]),
            np.array([w2[~neg].sum(), w2[neg].sum()]),
            per_group[:, 1:].max(0) if num_groups else np.zeros(2),
            float(per_group[:, 0].max()) if num_groups else 0.0,
        )
        return shaped, weights


def _gtpo_diagnostics(
    params, correct, group_of_row, num_groups, n_valid, entropy_sum, row_stats, shaped, w_sum, w_sq, w_max, conservation
) -> dict:
    """The ``gtpo/...`` diagnostics from per-row and per-polarity sums."""

    def ratio(num, den):
        return float(num) / float(den) if den > 0 else 0.0

    a2 = float(params.alpha2)
    out: dict[str, float] = {}
    tokens = [n_valid[correct].sum(), n_valid[~correct].sum()]
    for q, name in enumerate(("pos", "neg")):
        mean = ratio(w_sum[q], tokens[q]) if a2 > 0 else 0.0
        sq = ratio(w_sq[q], tokens[q]) if a2 > 0 else 0.0
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(max(sq - mean * mean, 0.0))
        out[f"weight_{name}_max"] = float(w_max[q]) if a2 > 0 else 0.0
    total, size, pos, negs = row_stats[:, 0], row_stats[:, 1], row_stats[:, 2], row_stats[:, 3]
    n_all = n_valid.sum()
    nonempty = n_valid > 0
    rows_per_group = np.bincount(group_of_row[nonempty], minlength=num_groups)
    correct_per_group = np.bincount(group_of_row[nonempty & correct], minlength=num_groups)
    live = rows_per_group > 0
    out.update(
        {
            "shaped_correct_mean": ratio(shaped[0], tokens[0]),
            "shaped_incorrect_mean": ratio(shaped[1], tokens[1]),
            "adv_correct_mean": ratio(total[correct].sum(), tokens[0]),
            "adv_incorrect_mean": ratio(total[~correct].sum(), tokens[1]),
            "adv_pos_mean": ratio((size + total).sum() / 2, pos.sum()),
            "adv_neg_mean": ratio((total - size).sum() / 2, negs.sum()),
            "adv_abs_mean": ratio(size.sum(), n_all),
            "frac_tokens_adv_pos": ratio(pos.sum(), n_all),
            "frac_tokens_adv_neg": ratio(negs.sum(), n_all),
            "conservation_err": float(conservation),
            "frac_groups_all_correct": ratio((live & (correct_per_group == rows_per_group)).sum(), live.sum()),
            "frac_groups_all_wrong": ratio((live & (correct_per_group == 0)).sum(), live.sum()),
            "entropy_correct_mean": ratio(entropy_sum[correct].sum(), tokens[0]),
            "entropy_incorrect_mean": ratio(entropy_sum[~correct].sum(), tokens[1]),
        }
    )
    return out


# GRPO-S
# ------


@njit(**jit_options())
def _grpo_s_row_sums(entropy, mask, lo, hi, tol, n_valid, last, entropy_sum, errors):
    """Rows ``lo:hi``: valid count, last valid column and ``sum max(H, 0)`` over the valid tokens.

    ``err`` counts valid mask values other than 1, rows whose entropy sum is not finite, entropies below ``-tol``.
    """
    length = entropy.shape[1]
    for i in range(lo, hi):  # the mask first, apart: one stream at a time runs faster than two interleaved
        m_row = mask[i]
        count = 0
        lst = -1
        bad = 0
        for t in range(length):  # branch-free, so that LLVM vectorises it
            m = m_row[t]
            valid = m != 0
            count += valid
            bad += valid & (m != 1)
            lst = max(lst, t if valid else -1)
        n_valid[i] = count
        last[i] = lst
        errors[0] += bad
    for i in range(lo, hi):
        h_row = entropy[i]
        count = n_valid[i]
        lst = last[i]
        total = 0.0  # raw sum: NaN / inf propagate into it
        below = 0.0  # sum of the negative values, taken back out of the total (clamped to 0)
        low = 0
        if count == lst + 1:  # dense: the mask is 1 on [0, count)
            for t in range(count):
                h = h_row[t]
                total += h
                below += min(h, 0.0)
                low += h < -tol
        else:
            m_row = mask[i]
            for t in range(lst + 1):
                h = h_row[t] if m_row[t] != 0 else 0.0
                total += h
                below += min(h, 0.0)
                low += h < -tol
        entropy_sum[i] = total - below
        errors[1] += not np.isfinite(total)
        errors[2] += low


@njit(**jit_options())
def _sequence_advantages(entropy_sum, n_valid, incorrect, base, group_of_row, num_groups, b1, b2, eps, joint, unbiased,
                         rtol, hbar, shaped, adv):  # fmt: skip
    """Eq. 8, Eq. 9 and the group normalisation on ``[B]`` (empty rows take no part and keep 0)."""
    b = n_valid.shape[0]
    count = np.zeros((2, num_groups))  # n, m per group
    sums = np.zeros((2, num_groups))  # sum_{O+} Hbar, sum_{O-} 1/(Hbar + eps)
    for i in range(b):
        if n_valid[i] == 0:
            continue
        hbar[i] = entropy_sum[i] / n_valid[i]
        q = 1 if incorrect[i] else 0
        count[q, group_of_row[i]] += 1.0
        sums[q, group_of_row[i]] += 1.0 / (hbar[i] + eps) if q else hbar[i]
    for i in range(b):
        if n_valid[i] == 0:
            continue
        j = group_of_row[i]
        if incorrect[i]:
            shaped[i] = b1 * base[i] - b2 * (1.0 / (hbar[i] + eps)) / (sums[1, j] + eps) * count[1, j]
        else:
            shaped[i] = b1 * base[i] + b2 * hbar[i] / (sums[0, j] + eps) * count[0, j]
    # each field f over the group's non-empty responses: zero_fill has two (a row's own polarity, zeros elsewhere),
    # joint one (the signed r^); stats[f, j] = (sum, sum of squares, sum |x|) around the group mean
    fields = 1 if joint else 2
    size = count[0] + count[1]
    first = np.zeros((fields, num_groups))
    absum = np.zeros((fields, num_groups))
    for i in range(b):
        if n_valid[i] == 0:
            continue
        for f in range(fields):
            x = shaped[i] if joint or (f == 1) == incorrect[i] else 0.0
            first[f, group_of_row[i]] += x
            absum[f, group_of_row[i]] += abs(x)
    mean = first / np.maximum(size, 1.0)
    second = np.zeros((fields, num_groups))
    for i in range(b):
        if n_valid[i] == 0:
            continue
        for f in range(fields):
            x = shaped[i] if joint or (f == 1) == incorrect[i] else 0.0
            second[f, group_of_row[i]] += (x - mean[f, group_of_row[i]]) ** 2
    for i in range(b):
        j = group_of_row[i]
        f = 0 if joint or not incorrect[i] else 1
        if n_valid[i] == 0 or size[j] <= 1:
            continue
        std = math.sqrt(second[f, j] / (size[j] - 1.0 if unbiased else size[j]))
        if std <= rtol * absum[f, j] / size[j]:
            continue
        adv[i] = (shaped[i] - mean[f, j]) / (std + eps)


@njit(**jit_options())
def _broadcast(mask, lo, hi, n_valid, last, adv, out):
    """``out[i, t] = adv[i]`` on the valid tokens of rows ``lo:hi``, 0 on every other position of those rows."""
    length = out.shape[1]
    for i in range(lo, hi):
        a = adv[i]
        o = out[i]
        if n_valid[i] == last[i] + 1:
            for t in range(n_valid[i]):
                o[t] = a
        else:
            m_row = mask[i]
            for t in range(last[i] + 1):
                o[t] = a if m_row[t] != 0 else 0.0
        for t in range(last[i] + 1, length):
            o[t] = 0.0


def grpo_s_kernel(entropy, response_mask, correct, base, gid, num_groups, params):
    """GRPO-S advantages and diagnostics on CPU tensors (validated by the caller).

    Args:
        entropy: ``[B, L]``. response_mask: ``[B, L]`` 0/1. correct: ``[B]`` bool. base: ``[B]`` float64 bases (GROP
        offset included). gid: ``[B]`` int64; num_groups: ``NG``. params: ``GRPOSParams``.

    Returns:
        ``(advantages [B, L] float32, diagnostics)``, as
        :func:`gtpo.algorithms.grpo_s.grpo_s_advantages`.
    """
    with compile_timer() as timer:
        outputs = _grpo_s(entropy, response_mask, correct, base, gid, num_groups, params)
    if timer.seconds > 0:
        outputs[-1]["kernel_compile_s"] = timer.seconds
    return outputs


def _grpo_s(entropy, response_mask, correct, base, gid, num_groups, params):
    # float32 / float64 entropy is read as it is, other float types as float32
    values = (entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()).detach()
    values = values.contiguous().numpy()
    mask = as_numpy_mask(response_mask)
    b, length = values.shape
    neg = (~correct).numpy()
    base = base.to(torch.float64).numpy()
    gid = gid.to(torch.long).numpy()
    eps, b1, b2 = float(params.eps), float(params.beta1), float(params.beta2)
    n = np.zeros(b, np.int64)
    last = np.full(b, -1, np.int64)
    hsum = np.zeros(b)
    threads = num_threads(b)
    errs = [np.zeros(3, np.int64) for _ in range(threads)]
    tol = float(params.neg_entropy_tol)
    run_blocks(_grpo_s_row_sums, b, threads, lambda lo, hi, w: (values, mask, lo, hi, tol, n, last, hsum, errs[w]))
    if sum(errs).any():
        raise BadValues

    hbar, shaped, adv_seq = np.zeros(b), np.zeros(b), np.zeros(b)
    _sequence_advantages(hsum, n, neg, base, gid, num_groups, b1, b2, eps, params.norm_mode == "joint",
                         params.std == "unbiased", float(params.zero_var_rtol), hbar, shaped, adv_seq)  # fmt: skip
    out = kernel_output(b, length)
    o = out.numpy()
    run_blocks(_broadcast, b, threads, lambda lo, hi, w: (mask, lo, hi, n, last, adv_seq, o), n)
    diag = _grpo_s_diagnostics(correct.numpy(), n > 0, gid, num_groups, base, hbar, shaped, adv_seq, b1, b2)
    return out, diag


def _grpo_s_diagnostics(correct, nonempty, gid, num_groups, base, hbar, shaped, adv, b1, b2) -> dict[str, float]:
    """The ``grpo_s/...`` diagnostics from the ``[B]`` quantities."""

    def mean(x, rows):
        return float(x[rows].sum()) / int(rows.sum()) if rows.any() else 0.0

    pos, negs = nonempty & correct, nonempty & ~correct
    term = shaped - b1 * base  # b2 * weight on correct rows, -b2 * weight on incorrect ones
    weight = np.where(correct, term, -term) / b2 if b2 > 0 else np.zeros_like(term)
    per_group = np.zeros((2, num_groups))
    np.add.at(per_group[0], gid[pos], term[pos] - b2)
    np.add.at(per_group[1], gid[negs], term[negs] + b2)
    rows_per_group = np.bincount(gid[nonempty], minlength=num_groups)
    correct_per_group = np.bincount(gid[pos], minlength=num_groups)
    live = rows_per_group > 0
    n_live = max(int(live.sum()), 1)
    n_seq = max(int(nonempty.sum()), 1)
    return {
        "seq_weight_pos_mean": mean(weight, pos),
        "seq_weight_pos_max": float(weight[pos].max()) if pos.any() else 0.0,
        "seq_weight_neg_mean": mean(weight, negs),
        "seq_weight_neg_max": float(weight[negs].max()) if negs.any() else 0.0,
        "adv_correct_mean": mean(adv, pos),
        "adv_incorrect_mean": mean(adv, negs),
        "adv_abs_mean": mean(np.abs(adv), nonempty),
        "frac_seq_adv_pos": float((nonempty & (adv > 0)).sum()) / n_seq,
        "frac_seq_adv_neg": float((nonempty & (adv < 0)).sum()) / n_seq,
        "conservation_err": float(np.abs(per_group).max()) if num_groups else 0.0,
        "frac_groups_all_correct": float((live & (correct_per_group == rows_per_group)).sum()) / n_live,
        "frac_groups_all_wrong": float((live & (correct_per_group == 0)).sum()) / n_live,
        "seq_entropy_correct_mean": mean(hbar, pos),
        "seq_entropy_incorrect_mean": mean(hbar, negs),
    }


# GTPO-trajectory
# ---------------


@njit(**jit_options())
def _traj_row_sums(entropy, mask, lo, hi, n_valid, last, entropy_sum):
    """Rows ``lo:hi``: valid count, last valid column and raw entropy sum over the valid tokens (padding unread)."""
    length = entropy.shape[1]
    for i in range(lo, hi):  # the mask first, apart: one stream at a time runs faster than two interleaved
        m_row = mask[i]
        count = 0
        lst = -1
        for t in range(length):
            valid = m_row[t] != 0
            count += valid
            lst = max(lst, t if valid else -1)
        n_valid[i] = count
        last[i] = lst
    for i in range(lo, hi):
        h_row = entropy[i]
        count = n_valid[i]
        lst = last[i]
        total = 0.0
        if count == lst + 1:
            for t in range(count):
                total += h_row[t]
        else:
            m_row = mask[i]
            for t in range(lst + 1):
                total += h_row[t] if m_row[t] != 0 else 0.0
        entropy_sum[i] = total


@njit(**jit_options())
def _traj_write(mask, lo, hi, n_valid, last, scale, lam_c, run_fwd, run_bwd, out):
    """``adv_{i,t} = scale_i * lambda_{i,t}`` on the valid tokens of rows ``lo:hi``, 0 on every other position."""
    one = np.float32(1.0)
    length = out.shape[1]
    for i in range(lo, hi):
        lst = last[i]
        a = scale[i]
        lc = lam_c[i]
        o = out[i]
        if n_valid[i] == lst + 1:
            for t in range(lst + 1):
                o[t] = a
        else:
            m_row = mask[i]
            for t in range(lst + 1):
                o[t] = a if m_row[t] != 0 else 0.0
        for t in range(min(run_fwd[i], lst + 1)):
            o[t] = (lc * (lc if t > lst - run_bwd[i] else one)) * a
        for t in range(max(lst + 1 - run_bwd[i], run_fwd[i]), lst + 1):
            o[t] = lc * a
        for t in range(lst + 1, length):
            o[t] = 0.0


def gtpo_traj_kernel(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini,
                     refuse_gaps=False):  # fmt: skip
    """GTPO-trajectory on CPU tensors after the group advantages (validated by the caller).

    Args:
        response_mask, responses, entropy: ``[B, L]``. gid: ``[B]`` int64; num_groups: ``NG``. params: resolved
        ``GTPOTrajParams``. adv, polarity, zero_var: ``centred_advantages`` of the scores. h_ini: ``<H>_ini`` or None
        (measured on this batch when the gate needs it). refuse_gaps: raise :class:`MaskGaps` after the first pass
        when a row has a gap (the caller then runs on its ``position``'s layout).

    Returns:
        ``(fields, h_ini, metrics)``: the ``[B, L]`` advantages and the per-row tensors of
        :class:`gtpo.algorithms.gtpo_traj.GTPOTrajOutput`, the ``<H>_ini`` used, the unprefixed metrics.
    """
    with compile_timer() as timer:
        out = _gtpo_traj(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini,
                         refuse_gaps)  # fmt: skip
    if timer.seconds > 0:
        out[2]["kernel_compile_s"] = timer.seconds
    return out


def _gtpo_traj(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini, refuse_gaps):
    # float32 / float64 entropy is read as it is, other float types as float32
    values = (entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()).detach()
    values = values.contiguous().numpy()
    mask = as_numpy_mask(response_mask)
    b, length = values.shape
    group_of_row = gid.to(torch.long).numpy()
    pol = polarity.numpy()
    n = np.zeros(b, np.int64)
    last = np.full(b, -1, np.int64)
    hsum = np.zeros(b)
    threads = num_threads(b)
    run_blocks(_traj_row_sums, b, threads, lambda lo, hi, w: (values, mask, lo, hi, n, last, hsum))
    if not np.isfinite(hsum).all():
        raise BadValues
    if refuse_gaps and bool((n != last + 1).any()):
        raise MaskGaps
    valid_rows = n > 0
    h_bar = (hsum / np.maximum(n, 1)).astype(np.float32)
    if params.use_ini_gate and h_ini is None:
        h_ini = float(h_bar[valid_rows].mean()) if valid_rows.any() else 0.0
    gate_open = params.use_ini_gate and h_ini > params.tau
    delta = np.ones(b, np.float32) if gate_open else (h_bar <= params.tau).astype(np.float32)

    f_len, b_len = conflict_runs(responses, mask, group_of_row, num_groups, pol, last)
    overlap = np.maximum(f_len + b_len - (last + 1), 0)
    n_conflict = f_len + b_len - overlap
    counted = np.maximum(f_len, b_len) if params.nconf_count == "official" else n_conflict
    n_conf = np.where(pol != 0, np.maximum(counted, 1), 1)

    a = adv.numpy()
    shaped = delta * (a - np.float32(params.gamma) * h_bar)
    if params.skip_zero_adv_groups:
        shaped = np.where(zero_var.numpy(), np.float32(0.0), shaped)
    if params.agg == "code_sum":
        shaped = shaped * np.bincount(group_of_row, minlength=num_groups).astype(np.float32)[group_of_row]
    scale = shaped / n_conf.astype(np.float32) if params.divide_by_nconf else shaped
    lam_c = np.where(pol > 0, params.lam_pos, params.lam_neg).astype(np.float32)
    lam_c = np.where(pol == 0, np.float32(1.0), lam_c)

    out = kernel_output(b, length)
    o = out.numpy()
    run_blocks(_traj_write, b, threads, lambda lo, hi, w: (mask, lo, hi, n, last, scale, lam_c, f_len, b_len, o), n)

    n_rows = max(int(valid_rows.sum()), 1)
    n_tok = max(float(n.sum()), 1.0)
    lam64 = lam_c.astype(np.float64)
    lam_row = n - n_conflict + lam64 * (n_conflict - overlap) + lam64 * lam64 * overlap
    metrics = {
        "conflict_token_frac": float(n_conflict.sum()) / n_tok,
        "pos_conflict_token_frac": float(n_conflict[pol > 0].sum()) / n_tok,
        "neg_conflict_token_frac": float(n_conflict[pol < 0].sum()) / n_tok,
        "conflict_traj_frac": float(((n_conflict > 0) & valid_rows).sum()) / n_rows,
        "filtered_traj_frac": float(((delta == 0) & valid_rows).sum()) / n_rows,
        "active_traj_frac": float(((pol != 0) & valid_rows).sum()) / n_rows,
        "zero_var_traj_frac": float((zero_var.numpy() & valid_rows).sum()) / n_rows,
        "mean_entropy": float(h_bar[valid_rows].mean()) if valid_rows.any() else 0.0,
        "shaped_adv_mean": float(shaped[valid_rows].mean()) if valid_rows.any() else 0.0,
        "adv_abs_mean": float((np.abs(scale).astype(np.float64) * lam_row).sum()) / n_tok,
        "filter_on": float(not gate_open),
    }
    if h_ini is not None:
        metrics["h_ini"] = float(h_ini)
    fields = {
        "advantages": out,
        "shaped_seq": torch.from_numpy(shaped),
        "mean_entropy": torch.from_numpy(h_bar),
        "delta": torch.from_numpy(delta),
        "n_conf": torch.from_numpy(n_conf),
        "run_fwd": torch.from_numpy(f_len),
        "run_bwd": torch.from_numpy(b_len),
        "last": torch.from_numpy(last),
        "lam_c": torch.from_numpy(lam_c),
    }
    return fields, h_ini, metrics
