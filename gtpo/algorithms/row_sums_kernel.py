"""Row sums of a ``[B, L]`` tensor on the kernels' threads: the sequence reward ``R_i = sum_t r_{i,t}``, the length.

verl's estimators take the sequence reward as ``token_level_rewards.sum(-1)`` (and GROP the lengths as
``response_mask.sum(-1)``). On CPU such an op runs on torch's
OpenMP pool, and libgomp's default wait policy keeps the pool's threads spinning for a while after the op ends:
a kernel started right after it on Python threads (:func:`gtpo.algorithms.kernel_support.run_blocks`) shares the
second core with a spinning thread and gains nothing from it. This pass reads the rows on the kernels' own threads
instead, accumulating in float64 (exact for verl's rewards, one non-zero per row; otherwise at least as accurate as
torch's float32 sum). A bool mask is read as bytes.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from gtpo.algorithms.kernel_support import as_numpy_mask, jit_options, num_threads, run_blocks

__all__ = ["row_sums"]


@njit(**jit_options())
def _row_sums(values, lo, hi, out):  # pragma: no cover - compiled
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
    run_blocks(_row_sums, rows, num_threads(rows), lambda lo, hi, w: (x, lo, hi, out))
    return torch.from_numpy(out).to(values.dtype if values.dtype.is_floating_point else torch.float64)
