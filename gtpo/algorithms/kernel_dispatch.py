"""Where an estimator's compiled kernel attaches: CPU tensors go to :mod:`gtpo.algorithms.kernels`, else the definition.

Each estimator's entry point holds the one place (numba is imported only by the call that needs it, so a process
that never computes advantages, e.g. a Ray actor worker that only registers the plugin, never imports it)::

    if entropy.device.type == "cpu" and kernel_on("gtpo_token"):
        with kernel_guard("gtpo_token"):  # numba missing or failing: the definition below
            from gtpo.algorithms import kernels

            try:
                return kernels.gtpo_token_kernel(...)
            except kernels.BadValues:  # a bad input value: the definition's checks name it
                pass
    check_token_values(...)
    return gtpo_token_definition(...)

If numba is missing or :mod:`gtpo.algorithms.kernels` fails to import, or a kernel fails to compile,
:func:`kernel_guard` warns once, switches that kernel off for the process and lets the estimator evaluate its
definition.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["kernel_guard", "kernel_on", "row_sums"]

_OFF: set[str] = set()  # kernels that failed to import or to compile in this process


def kernel_on(name: str) -> bool:
    """Whether the kernel ``name`` may run: it has not failed in this process."""
    return name not in _OFF


@contextmanager
def kernel_guard(name: str) -> Iterator[None]:
    """Around the import and the call of a kernel: an error importing :mod:`gtpo.algorithms.kernels` (numba missing
    or broken) or a numba error while compiling switches the kernel off for this process after a warning and is
    swallowed, so that the estimator's code after the ``with`` block evaluates the definition. Every other error of
    the call (a ``ValueError`` on bad inputs, say) is raised."""
    try:
        yield
    except Exception as err:
        imported = sys.modules.get("gtpo.algorithms.kernels") is not None  # one that failed to import is not
        if imported and not _is_numba_error(err):
            raise
        if name not in _OFF:
            _OFF.add(name)
            warnings.warn(
                f"{name}: compiled kernel {'failed' if imported else 'unavailable'} ({type(err).__name__}: {err}); "
                "evaluating the float64 torch definition instead (slower, more memory)",
                RuntimeWarning,
                stacklevel=3,
            )


def _is_numba_error(err: BaseException) -> bool:
    numba_errors = sys.modules.get("numba.core.errors")
    return numba_errors is not None and isinstance(err, numba_errors.NumbaError)


# what the row-sum kernel reads as it is (bool as bytes); other dtypes are summed by torch
_ROW_SUM_DTYPES = (torch.float32, torch.float64, torch.bool, torch.uint8, torch.int32, torch.int64)


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """``values.sum(-1)`` of a ``[B, L]`` tensor, detached: the sequence reward of ``token_level_rewards``, the length
    of ``response_mask``. On CPU it runs on the kernels' threads, not on torch's OpenMP pool (whose threads would then
    spin beside the kernel's); float inputs keep their dtype, others give float64.
    """
    x = values.detach()
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in _ROW_SUM_DTYPES and kernel_on("row_sums"):
        with kernel_guard("row_sums"):
            from gtpo.algorithms import kernels

            return kernels.row_sums(x)
    return x.sum(-1, dtype=x.dtype if x.dtype.is_floating_point else torch.float64)
