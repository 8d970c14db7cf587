"""GRPO-S's compiled CPU kernel: Eq. 8, 9 and §2.3 of Tan et al., arXiv 2508.04349, as loops over rows (numba).

The definition is :func:`gtpo.algorithms.grpo_s.grpo_s_reference` (float64 torch); this kernel computes the same
advantages and diagnostics, tested against it, in one read of the entropy and the mask and one write:

1. :func:`_row_sums` (per row): the valid count ``|o_i|`` and ``sum_t max(H_{i,t}, 0)`` over the valid tokens (a
   negative entropy within ``neg_entropy_tol`` counts as 0), with the input checks; ``Hbar_i`` is their ratio (Eq. 8).
2. :func:`_sequence_advantages` (per group, on ``[B]``): Eq. 9 over the group's non-empty responses,

       r^+_i = b1 base_i + b2 Hbar_i / (sum_{O+} Hbar + eps) n,  r^-_j = b1 base_j - b2 (1/(Hbar_j+eps)) /
       (sum_{O-} 1/(Hbar+eps) + eps) m,

   then the group normalisation of ``norm_mode`` (``zero_fill``: the r^+ field and the r^- field with their zeros;
   ``joint``: the signed r^), a field with fewer than two responses or ``std <= zero_var_rtol * mean|field|`` being
   constant (advantage 0).
3. :func:`_broadcast` (per row): the advantage on every valid token, 0 on padding.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit

from gtpo.algorithms.kernel_support import (
    as_numpy_mask,
    compile_timer,
    jit_options,
    kernel_output,
    num_threads,
    run_blocks,
)
from gtpo.algorithms.shaping_inputs import check_token_values

__all__ = ["grpo_s_kernel"]


@njit(**jit_options())
def _row_sums(entropy, mask, lo, hi, tol, n_valid, last, entropy_sum, errors):
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
        :func:`gtpo.algorithms.entropy_shaping.grpo_s_advantages`.
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
    run_blocks(_row_sums, b, threads, lambda lo, hi, w: (values, mask, lo, hi, tol, n, last, hsum, errs[w]))
    if sum(errs).any():
        check_token_values(entropy, response_mask, tol)
        raise ValueError("entropy / response_mask failed a consistency check")  # pragma: no cover

    hbar, shaped, adv_seq = np.zeros(b), np.zeros(b), np.zeros(b)
    _sequence_advantages(hsum, n, neg, base, gid, num_groups, b1, b2, eps, params.norm_mode == "joint",
                         params.std == "unbiased", float(params.zero_var_rtol), hbar, shaped, adv_seq)  # fmt: skip
    out = kernel_output(b, length)
    o = out.numpy()
    run_blocks(_broadcast, b, threads, lambda lo, hi, w: (mask, lo, hi, n, last, adv_seq, o), n)
    diag = _diagnostics(correct.numpy(), n > 0, gid, num_groups, base, hbar, shaped, adv_seq, b1, b2)
    return out, diag


def _diagnostics(correct, nonempty, gid, num_groups, base, hbar, shaped, adv, b1, b2) -> dict[str, float]:
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
