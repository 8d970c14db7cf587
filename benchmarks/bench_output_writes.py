"""Writing a kernel's ``[B, L]`` float32 output at 1 and 2 threads: fresh memory against recycled memory.

Every estimator ends with a write pass: one advantage per token into a new ``[B, L]`` float32 tensor. This script
times that pass alone, as the kernels run it (a numba ``nogil`` loop over row blocks on ``run_blocks``' threads,
lengths uniform in ``[L/8, L]``), into four kinds of memory, each allocated anew before every timed write:

* ``fresh, huge pages``  an anonymous mapping advised for transparent huge pages, as new: every 2 MB page is
  faulted in (and zeroed by the OS) by the write itself; the padding is left to the OS's zeros;
* ``fresh, 4 KB pages``  the same without the advice;
* ``torch.empty``        torch's allocation (fresh pages too at this size), every element written;
* ``kernel_output``      the recipe's output (:func:`gtpo.algorithms.kernels.kernel_output`): the previous
  output's memory, freed and recycled, every element written, the padding's zeros included.

On the 2-core virtual machine this was measured on, a second thread speeds up the recycled write by a third to a
half; into fresh huge-page memory it does not (the 2,048-row write got slower), and 4 KB pages scale but cost four
to five times as much.

Usage: .venv/bin/python benchmarks/bench_output_writes.py [--sizes 2048x4096,8192x4096] [--repeats 15] [--no-write]
Writes its table into benchmarks/RESULTS.md (section ``output-writes``; other sections are kept).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks import _common as C  # noqa: E402


def _kernels():
    from numba import njit

    from gtpo.algorithms.kernels import jit_options

    @njit(**jit_options())
    def valid_only(lo, hi, n, adv, out):
        for i in range(lo, hi):
            o = out[i]
            for t in range(n[i]):
                o[t] = adv[i]

    @njit(**jit_options())
    def whole_rows(lo, hi, n, adv, out):
        length = out.shape[1]
        for i in range(lo, hi):
            o = out[i]
            for t in range(n[i]):
                o[t] = adv[i]
            for t in range(n[i], length):
                o[t] = 0.0

    return valid_only, whole_rows


def _mapping(rows: int, cols: int, huge: bool):
    """A fresh ``[rows, cols]`` float32 mapping: the kernels' own (advised for huge pages) or a plain one."""
    import numpy as np
    import torch

    from gtpo.algorithms.kernels import _new_mapping

    nbytes = rows * cols * 4
    buf = _new_mapping(nbytes) if huge else mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.float32).reshape(rows, cols))


def measure(rows: int, cols: int, threads: int, repeats: int) -> dict[str, float]:
    """Median seconds of the write pass into each kind of memory, at ``threads`` threads."""
    import numpy as np
    import torch

    from gtpo.algorithms.kernels import kernel_output, run_blocks

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    n = rng.integers(max(1, cols // 8), cols + 1, rows).astype(np.int64)
    adv = rng.standard_normal(rows).astype(np.float32)
    valid_only, whole_rows = _kernels()
    kinds = {
        "fresh, huge pages": (lambda: _mapping(rows, cols, True), valid_only),
        "fresh, 4 KB pages": (lambda: _mapping(rows, cols, False), valid_only),
        "torch.empty": (lambda: torch.empty(rows, cols), whole_rows),
        "kernel_output": (lambda: kernel_output(rows, cols), whole_rows),
    }
    medians = {}
    for name, (allocate, write) in kinds.items():
        times = []
        for rep in range(repeats + 1):  # the first round compiles and warms the recycled buffer
            out = allocate()
            o = out.numpy()
            t0 = time.perf_counter()
            run_blocks(write, rows, threads, lambda lo, hi, w, o=o: (lo, hi, n, adv, o), n)
            if rep:
                times.append(time.perf_counter() - t0)
            del out, o
        medians[name] = statistics.median(times)
    return medians


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2048x4096,8192x4096", help="comma list of BxL")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = p.parse_args()
    load = os.getloadavg()[0]
    lines = ["| B x L | memory | 1 thread | 2 threads | 2 / 1 |", "|---|---|---:|---:|---:|"]
    for part in args.sizes.split(","):
        rows, cols = (int(x) for x in part.lower().split("x"))
        one, two = measure(rows, cols, 1, args.repeats), measure(rows, cols, 2, args.repeats)
        for name in one:
            lines.append(f"| {rows}x{cols} | {name} | {one[name] * 1e3:.2f} ms | {two[name] * 1e3:.2f} ms | "
                         f"{two[name] / one[name]:.2f} |")  # fmt: skip
    text = (f"Load average {load:.1f} at the start; median of {args.repeats} writes each.\n\n" + "\n".join(lines)
            + "\n")  # fmt: skip
    C.report("output-writes", "Writing a kernel's output: fresh memory against recycled", text, not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
