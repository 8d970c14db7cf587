"""What the estimators' compiled CPU kernels share: numba's options and cache, threads, compile time, outputs.

Not an equation module. Each estimator has one numba kernel (``gtpo_token_kernel``, ``grpo_s_kernel``,
``trajectory_kernel``) beside its float64 torch definition (``gtpo_token``, ``grpo_s``, ``trajectory``); the estimator
calls the kernel for CPU tensors and the definition otherwise, through :mod:`gtpo.algorithms.kernel_dispatch`. Every
kernel module imports this one (and numba); nothing here imports numba at import time:

- Compiled code is cached on disk (numba ``cache=True``; :func:`jit_options` chooses the folder before the first
  kernel is decorated): next to the module when the package directory is writable, else numba's user-wide cache
  (``~/.cache/numba``); when neither is writable (a read-only image with a read-only home), ``NUMBA_CACHE_DIR`` is
  pointed at a per-user folder under the temp directory. numba unpickles a cache's index before any freshness
  check, so a folder someone else could write is code they choose: the folder numba would pick must be this user's
  and writable by neither group nor others (:mod:`gtpo.private_files`), else the temp folder is used; that one is
  created 0700, and if someone planted it in advance, a fresh ``mkdtemp`` folder is used instead (with a warning:
  compiled once per process tree, not reused). An explicit ``NUMBA_CACHE_DIR`` always wins, unchecked: the user's
  choice.
- :class:`compile_timer` measures the time spent compiling (or loading from the cache) during one call; the
  estimators report it as ``<estimator>/kernel_compile_s`` on the call that paid it (the trainer's first step).
- Threads: a kernel runs on ``torch.get_num_threads()`` threads (1 inside a Ray actor, which gets
  ``OMP_NUM_THREADS=1``), as plain Python threads each running a GIL-free (``nogil``) serial kernel on contiguous
  blocks of rows (:func:`run_blocks`: four per thread, balanced by the tokens each row holds where they are known,
  taken from a queue), each thread with its own partial sums, reduced once. numba's own threading layer
  (OpenMP / TBB / workqueue) is never started, so nothing competes with torch's OpenMP pool, nothing stays alive
  between calls and nothing can deadlock across a fork. The group scopes split whole groups, four shares per
  thread taken from a queue (:func:`row_shares`).
- Outputs: :func:`kernel_output` gives the ``[B, L]`` float32 outputs, large ones advised for transparent huge
  pages and recycled once freed (writing fresh memory also faults in every page, which did not get faster with a
  second thread); the write passes therefore write every element, the zeros of padding included.
"""

from __future__ import annotations

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

from gtpo.private_files import check_private_dir, private_dir

__all__ = ["jit_options", "compile_timer", "num_threads", "run_threads", "row_shares", "blocks", "run_blocks",
           "kernel_output", "as_numpy_mask", "warn_once"]  # fmt: skip

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
