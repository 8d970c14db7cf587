"""Conflict runs (numba): the leading and trailing tokens a completion shares with completions of both polarities.

GTPO-trajectory (Simoni et al., arXiv 2508.03772; :mod:`gtpo.algorithms.trajectory_kernel`) weights these tokens by
``lambda``, and GTPO-token's ``conflict_mask`` option (:mod:`gtpo.algorithms.gtpo_token_kernel`) does the same with
correctness as the polarity; the definition is :func:`gtpo.algorithms.conflict_tokens.conflict_parts` (torch).

Per group with both polarities, position by position from the start (forward) and from each row's last valid token
(backward, right-aligned), a row's run goes on while its token is shared by at least one positive and one negative
active completion at that aligned position (the row itself counts) and stops at the first position where it is not,
or where the row's mask is 0 (docs/ALGORITHMS.md §6.2). The runs are the first ``run_fwd[i]`` and the last
``run_bwd[i]`` valid columns of row i; the two directions run on two threads.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from gtpo.algorithms.kernel_support import jit_options, run_threads

__all__ = ["conflict_runs"]


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
