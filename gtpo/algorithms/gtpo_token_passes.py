"""GTPO-token's compiled passes over rows (numba): Eq. 3 and Eq. 5's per-position sums, and the advantages' write.

The loops of :mod:`gtpo.algorithms.gtpo_token_kernel` (whose docstring gives the notation and the algebra), each
over a set of rows of ``entropy`` / ``mask`` (``[B, L]``):

- pass 1, :func:`scan`: per position ``t`` and polarity q, ``cnt_t``, ``S_t = sum_i v_{i,t}``, ``Q_t = sum v^2``,
  ``BV_t = sum (b_i - b0) v`` and ``max v`` (``v = max(H, 0)`` for correct rows, Eq. 3; ``1 / (max(H, 0) + eps)`` for
  incorrect ones, Eq. 5: an entropy within ``neg_entropy_tol`` below 0 is clamped to 0 before either), and per
  row its valid count, last valid column and raw entropy sum, counting the input errors (a mask value other than 0
  and 1 on a valid token, a non-finite entropy, one below ``-tol``); :func:`coefficients` turns the sums into
  ``c_t = cnt_t / (S_t + eps)``;
- :func:`moments`: per row ``sum (w - 1)``, ``sum (w - 1)^2`` and ``sum |x|`` with ``w = c_t v_t`` (Eq. 6's sets
  when they are not in closed form);
- pass 2, :func:`write`: ``adv_{i,t} = (g_i + k_i c_t v_{i,t}) lambda_{i,t}`` and the per-row sums of the
  diagnostics.

Dense rows (valid exactly on ``[0, n_i)``, the usual right-padded layout) take one loop from the entropy to the sums
(:func:`_accumulate`) and one from the entropy to the output (:func:`_emit_dense`); padding is never read.
Eq. 6's compiled parts (:func:`set_scales`, :func:`add_rows`, :func:`row_scales`) and the group scopes' sweep
(:func:`group_sweep`) are here too, beside the loops they call (numba caches a function by its own file only);
their Python side is :mod:`gtpo.algorithms.gtpo_token_kernel`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from gtpo.algorithms.kernel_support import jit_options

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
