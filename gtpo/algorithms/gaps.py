"""The signal a compiled kernel gives its estimator's entry point when a response holds tool tokens inside it."""

from __future__ import annotations

__all__ = ["MaskGaps"]


class MaskGaps(Exception):
    """Raised by an estimator's first pass when a row's model tokens are not one block from column 0 while its knobs
    read another position than the column: the entry point then runs it on that position's layout
    (:mod:`gtpo.algorithms.token_positions`). The compiled kernels find gaps in a pass they make anyway, so a batch
    without them pays nothing for the check."""
