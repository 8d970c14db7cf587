"""Which code computes: an estimator's compiled CPU kernel, or its float64 torch definition when the kernel cannot run.

The estimators (:mod:`gtpo.algorithms.entropy_shaping`, :mod:`gtpo.algorithms.trajectory`) and :func:`row_sums` import
their kernel module (``gtpo.algorithms.<name>``, numba with it) inside the call that needs it, so that a process that
never computes advantages, e.g. a Ray actor worker that only registers the plugin, never imports numba::

    if on_cpu and kernel_on("gtpo_token_kernel"):
        with kernel_guard("gtpo_token_kernel"):  # numba missing or failing: the definition below
            from gtpo.algorithms import gtpo_token_kernel

            return gtpo_token_kernel.gtpo_token_kernel(...)
    return gtpo_token_reference(...)

If numba is missing or the module fails to import, or a kernel fails to compile, :func:`kernel_guard` warns once,
switches that kernel off for the process (:func:`kernel_on`) and lets the estimator evaluate its definition. What
the kernels share once they run (threads, outputs, numba's cache) is :mod:`gtpo.algorithms.kernel_support`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gtpo.algorithms.kernel_support import warn_once

__all__ = ["kernel_on", "kernel_guard", "row_sums"]

_OFF: set[str] = set()  # kernel modules that failed to import or to compile in this process


def kernel_on(name: str) -> bool:
    """Whether the kernel module ``gtpo.algorithms.<name>`` may run: it has not failed in this process."""
    return name not in _OFF


@contextmanager
def kernel_guard(name: str) -> Iterator[None]:
    """Around the import and the call of the kernel module ``gtpo.algorithms.<name>``: any error while importing it
    (numba missing or broken) or a numba error while compiling switches the kernel off for this process after a
    warning (once) and is swallowed, so that the estimator's code after the ``with`` block evaluates the definition.
    Every other error of the call (a ``ValueError`` on bad inputs, say) is raised."""
    try:
        yield
    except Exception as err:
        imported = sys.modules.get(f"gtpo.algorithms.{name}") is not None  # one that failed to import is not
        if imported and not _is_numba_error(err):
            raise
        _OFF.add(name)
        warn_once(
            name,
            f"{name}: compiled kernel {'failed' if imported else 'unavailable'} ({type(err).__name__}: {err}); "
            "evaluating the float64 torch definition instead (slower, more memory)",
        )


def _is_numba_error(err: BaseException) -> bool:
    numba_errors = sys.modules.get("numba.core.errors")
    return numba_errors is not None and isinstance(err, numba_errors.NumbaError)


# what the row-sum kernel reads as it is (bool as bytes); other dtypes are summed by torch
_ROW_SUM_DTYPES = (torch.float32, torch.float64, torch.bool, torch.uint8, torch.int32, torch.int64)


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """``values.sum(-1)`` of a ``[B, L]`` tensor, detached: the sequence reward of ``token_level_rewards``, the length
    of ``response_mask``. On CPU it runs on the kernels' threads, not on torch's OpenMP pool
    (:mod:`gtpo.algorithms.row_sums_kernel` says why); float inputs keep their dtype, others give float64.
    """
    x = values.detach()
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in _ROW_SUM_DTYPES and kernel_on("row_sums_kernel"):
        with kernel_guard("row_sums_kernel"):
            from gtpo.algorithms import row_sums_kernel

            return row_sums_kernel.row_sums(x)
    return x.sum(-1, dtype=x.dtype if x.dtype.is_floating_point else torch.float64)
