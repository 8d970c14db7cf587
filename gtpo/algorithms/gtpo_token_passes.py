"""GTPO-token's compiled passes over rows (numba): Eq. 3 and Eq. 5's per-position sums, and the advantages' write.

The loops of :mod:`gtpo.algorithms.gtpo_token_kernel` (whose docstring gives the notation and the algebra), each
over a set of rows of ``H`` / ``M`` (``[B, L]``):

- pass 1, :func:`_scan`: per position ``t`` and polarity q, ``cnt_t``, ``S_t = sum_i v_{i,t}``, ``Q_t = sum v^2``,
  ``BV_t = sum (b_i - b0) v`` and ``max v`` (``v = max(H, 0)`` for correct rows, Eq. 3; ``1 / (max(H, 0) + eps)``
  for incorrect ones, Eq. 5: an entropy within ``neg_entropy_tol`` below 0 is clamped to 0 before either), and per
  row its valid count, last valid column and raw entropy sum, counting the input errors (a mask value other than 0
  and 1 on a valid token, a non-finite entropy, one below ``-tol``); :func:`_coefficients` turns the sums into
  ``c_t = cnt_t / (S_t + eps)``;
- :func:`_moments`: per row ``sum (w - 1)``, ``sum (w - 1)^2`` and ``sum |x|`` with ``w = c_t v_t`` (Eq. 6's sets
  when they are not in closed form);
- pass 2, :func:`_write`: ``adv_{i,t} = (g_i + k_i c_t v_{i,t}) lambda_{i,t}`` and the per-row sums of the
  diagnostics.

Dense rows (valid exactly on ``[0, n_i)``, the usual right-padded layout) take one loop from the entropy to the sums
(:func:`_accumulate`) and one from the entropy to the output (:func:`_emit_dense`); padding is never read.
Eq. 6's compiled parts (:func:`_set_scales`, :func:`_add_rows`, :func:`_row_scales`) and the group scopes' sweep
(:func:`_group_sweep`) are here too, beside the loops they call (numba caches a function by its own file only);
their Python side is :mod:`gtpo.algorithms.gtpo_token_sets`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from gtpo.algorithms.kernel_support import JIT_OPTIONS

_ZERO_FILL, _JOINT, _SPLIT = 0, 1, 2


@njit(**JIT_OPTIONS)
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


@njit(**JIT_OPTIONS)
def _mask_rows(M, rows, n, last):
    """:func:`_mask_row` of each row in ``rows`` into ``n`` / ``last``."""
    for i in rows:
        n[i], last[i], _ = _mask_row(M[i])


@njit(**JIT_OPTIONS)
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


@njit(**JIT_OPTIONS)
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


@njit(**JIT_OPTIONS)
def _scan(H, M, rows, neg, ebase, eps, tol, acc, hist, n, last, hsum, err):
    """Pass 1 over ``rows``: per position ``acc[q] = (cnt, S, Q, BV, max v)``; per row count, last column, entropy sum.

    ``cnt`` of dense rows (valid exactly on ``[0, n_i)``) goes to ``hist[q, n_i]`` and is expanded by
    :func:`_coefficients`. ``err`` counts non-binary mask values, rows with a non-finite entropy, entropies below
    ``-tol``. Returns the largest last valid column.
    """
    v = np.empty(H.shape[1])
    top = -1
    for i in rows:  # the mask first, apart: one stream at a time runs faster than the two interleaved row by row
        count, lst, bad = _mask_row(M[i])
        n[i] = count
        last[i] = lst
        err[0] += bad
        top = max(top, lst)
    for i in rows:
        count = n[i]
        lst = last[i]
        q = 1 if neg[i] else 0
        dense = count == lst + 1
        e = ebase[i]
        cnt, s_t, q_t, bv, top_v = acc[q, 0], acc[q, 1], acc[q, 2], acc[q, 3], acc[q, 4]
        if dense and e == 0.0:  # the common row: one loop from the entropy to the sums
            total, low = _accumulate(H[i], count, q == 1, eps, tol, s_t, q_t, top_v)
        else:
            total, low = _values(H[i], M[i], lst + 1, dense, q == 1, eps, tol, v)
            for t in range(lst + 1):
                s_t[t] += v[t]
                q_t[t] += v[t] * v[t]
                top_v[t] = max(top_v[t], v[t])
                bv[t] += e * v[t]
        if dense:
            hist[q, count] += 1.0
        else:
            m_row = M[i]
            for t in range(lst + 1):
                cnt[t] += m_row[t] != 0
        hsum[i] = total
        err[1] += not np.isfinite(total)
        err[2] += low
    return top


@njit(**JIT_OPTIONS)
def _coefficients(acc, hist, stop, eps, a2, c, out):
    """Dense rows' counts into ``cnt_t``, then ``c_t = cnt_t / (S_t + eps)`` for ``t < stop``.

    ``out`` receives the conservation error ``a2 * max_t |c_t S_t - cnt_t|`` (Prop. 2.2 up to the eps guard) and
    each polarity's largest weight ``max_t c_t max_i v_{i,t}``.
    """
    out[0] = 0.0
    for q in range(2):
        active = 0.0
        out[1 + q] = 0.0
        for t in range(stop - 1, -1, -1):
            active += hist[q, t + 1]
            acc[q, 0, t] += active
            c[q, t] = acc[q, 0, t] / (acc[q, 1, t] + eps)
            out[0] = max(out[0], a2 * abs(c[q, t] * acc[q, 1, t] - acc[q, 0, t]))
            out[1 + q] = max(out[1 + q], c[q, t] * acc[q, 4, t])


@njit(**JIT_OPTIONS)
def _moments(H, M, rows, neg, c, eps, tol, a1, a2, base, n, last, mom):
    """Per row, over its valid tokens with ``w = c_t v_t``: ``mom[i] = (sum (w - 1), sum (w - 1)^2, sum |x|)``."""
    v = np.empty(H.shape[1])
    for i in rows:
        lst = last[i]
        dense = n[i] == lst + 1
        q = 1 if neg[i] else 0
        s = -1.0 if q else 1.0
        _values(H[i], M[i], lst + 1, dense, q == 1, eps, tol, v)
        cq = c[q]
        ab = a1 * base[i]
        d = 0.0
        d2 = 0.0
        ax = 0.0
        m_row = M[i]
        for t in range(lst + 1):
            valid = dense or m_row[t] != 0
            w = cq[t] * v[t]
            dw = w - 1.0 if valid else 0.0
            d += dw
            d2 += dw * dw
            ax += abs(ab + s * a2 * w) if valid else 0.0
        mom[i, 0] = d
        mom[i, 1] = d2
        mom[i, 2] = ax


@njit(**JIT_OPTIONS)
def _emit(v, stop, o):
    """``o[t] = v_t`` for ``t < stop``; returns ``(sum, sum |.|, #> 0, #< 0)`` of what it wrote."""
    total = 0.0
    size = 0.0
    pos = 0
    negs = 0
    for t in range(stop):
        a = v[t]
        o[t] = a
        total += a
        size += abs(a)
        pos += a > 0.0
        negs += a < 0.0
    return total, size, pos, negs


@njit(**JIT_OPTIONS)
def _emit_dense(h_row, stop, negative, eps, c, g, k, o):
    """:func:`_values` and :func:`_emit` of a dense row in one loop (no buffer): ``o[t] = g + k c_t v_t``."""
    total = 0.0
    size = 0.0
    pos = 0
    negs = 0
    for t in range(stop):  # `negative` is loop-invariant: LLVM unswitches the loop into one per polarity
        hc = max(h_row[t], 0.0)
        a = g + k * c[t] * (1.0 / (hc + eps) if negative else hc)
        o[t] = a
        total += a
        size += abs(a)
        pos += a > 0.0
        negs += a < 0.0
    return total, size, pos, negs


@njit(**JIT_OPTIONS)
def _write(H, M, rows, neg, c, eps, tol, g, k, n, last, fwd, bwd, lam, out, rdiag):
    """Pass 2: ``adv = (g_i + k_i c_t v_t) * lambda_{i,t}`` on the valid tokens, 0 on every other position.

    ``lambda`` is ``lam[i]`` on the first ``fwd[i]`` and the last ``bwd[i]`` valid columns (the conflict runs), 1
    elsewhere. ``rdiag[i] = (sum adv, sum |adv|, #adv > 0, #adv < 0)``.
    """
    v = np.empty(H.shape[1])
    for i in rows:
        lst = last[i]
        o = out[i]
        if lst < 0:  # no valid token
            o[:] = 0.0
            continue
        dense = n[i] == lst + 1
        q = 1 if neg[i] else 0
        cq = c[q]
        gi = g[i]
        ki = k[i]
        if dense and fwd[i] == 0 and bwd[i] == 0:  # the common row: one loop from the entropy to the output
            total, size, pos, negs = _emit_dense(H[i], lst + 1, q == 1, eps, cq, gi, ki, o)
        else:
            _values(H[i], M[i], lst + 1, dense, q == 1, eps, tol, v)
            for t in range(lst + 1):
                v[t] = gi + ki * cq[t] * v[t]
            if not dense:
                m_row = M[i]
                for t in range(lst + 1):
                    v[t] = v[t] if m_row[t] != 0 else 0.0
            for t in range(min(fwd[i], lst + 1)):
                v[t] *= lam[i]
            for t in range(max(lst + 1 - bwd[i], 0), lst + 1):
                v[t] *= lam[i]
            total, size, pos, negs = _emit(v, lst + 1, o)
        o[lst + 1 :] = 0.0
        rdiag[i, 0] = total
        rdiag[i, 1] = size
        rdiag[i, 2] = pos
        rdiag[i, 3] = negs


@njit(**JIT_OPTIONS)
def _set_scales(st, x0, mode, unbiased, rtol, eps, mean, inv):
    """Eq. 6 per polarity q from ``st[q] = (tokens, sum (x - x0), sum (x - x0)^2, sum |x|)``: the set's mean and
    ``1 / (std + eps)`` (0 for a constant set: fewer than two tokens, or ``std <= rtol * mean|x|``)."""
    n = np.zeros(2)
    mu = np.zeros(2)
    m2 = np.zeros(2)
    for q in range(2):
        n[q] = st[q, 0]
        if n[q] > 0:
            mu[q] = x0[q] + st[q, 1] / n[q]
            m2[q] = max(st[q, 2] - st[q, 1] * st[q, 1] / n[q], 0.0)
    total = n[0] + n[1]
    for q in range(2):
        if mode == _SPLIT:
            size, centre, spread, absum = n[q], mu[q], m2[q], st[q, 3]
        elif mode == _JOINT:
            size = total
            centre = (n[0] * mu[0] + n[1] * mu[1]) / total if total > 0 else 0.0
            spread = m2[0] + m2[1] + n[0] * (mu[0] - centre) ** 2 + n[1] * (mu[1] - centre) ** 2
            absum = st[0, 3] + st[1, 3]
        else:  # zero_fill: the other polarity's tokens are zeros of this field
            size = total
            centre = n[q] * mu[q] / total if total > 0 else 0.0
            spread = m2[q] + n[q] * (mu[q] - centre) ** 2 + (total - n[q]) * centre * centre
            absum = st[q, 3]
        denom = max(size - 1.0, 1.0) if unbiased else max(size, 1.0)
        std = math.sqrt(spread / denom) if size > 1 else 0.0
        constant = size <= 1 or std <= rtol * absum / size
        mean[q] = centre
        inv[q] = 0.0 if constant else 1.0 / (std + eps)


@njit(**JIT_OPTIONS)
def _add_rows(rows, neg, n, mom, base, b0, a1, a2, st):
    """Fold rows into ``st`` (:func:`_set_scales`) from their moments; returns nothing."""
    for i in rows:
        q = 1 if neg[i] else 0
        s = -1.0 if q else 1.0
        e = base[i] - b0[q]
        ni = n[i]
        st[q, 0] += ni
        st[q, 1] += a1 * e * ni + s * a2 * mom[i, 0]
        st[q, 2] += a1 * a1 * e * e * ni + 2.0 * s * a1 * a2 * e * mom[i, 0] + a2 * a2 * mom[i, 1]
        st[q, 3] += mom[i, 2]


@njit(**JIT_OPTIONS)
def _row_scales(rows, neg, base, a1, a2, mean, inv, g, k):
    """``g_i = (a1 b_i - mean) / (std + eps)`` and ``k_i = s a2 / (std + eps)`` of each row's set."""
    for i in rows:
        q = 1 if neg[i] else 0
        g[i] = (a1 * base[i] - mean[q]) * inv[q]
        k[i] = (-a2 if q else a2) * inv[q]


@njit(**JIT_OPTIONS)
def _group_sweep(H, M, order, gptr, groups, neg, ebase, base, b0, x0, params, c_batch, by_group, write,
                 n, last, hsum, err, mom, cons, g, k, fwd, bwd, lam, out, rdiag):  # fmt: skip
    """The group scopes, for ``groups`` (one thread's share), rows ``order[gptr[j]:gptr[j + 1]]`` of group j.

    ``params = (eps, tol, a1, a2, mode, unbiased, rtol)``. ``by_group``: weights per group (``weight_scope="group"``),
    else ``c_batch``. ``write``: 0 = per-row moments only (the first visit of ``norm_scope="batch"``); 1 = Eq. 6 per
    group, then the advantages; 2 = the advantages with the ``g`` / ``k`` already set.
    """
    eps, tol, a1, a2, mode, unbiased, rtol = params
    length = H.shape[1]
    acc = np.zeros((2, 5, length))
    hist = np.zeros((2, length + 1))
    c = np.zeros((2, length)) if by_group else c_batch
    st = np.zeros((2, 4))
    mean = np.zeros(2)
    inv = np.zeros(2)
    for j in groups:
        rows = order[gptr[j] : gptr[j + 1]]
        if by_group:
            top = _scan(H, M, rows, neg, ebase, eps, tol, acc, hist, n, last, hsum, err)
            _coefficients(acc, hist, top + 1, eps, a2, c, cons[j])
            acc[:, :, : top + 1] = 0.0
            hist[:] = 0.0
        if write != 2:
            _moments(H, M, rows, neg, c, eps, tol, a1, a2, base, n, last, mom)
        if write == 1:
            st[:] = 0.0
            _add_rows(rows, neg, n, mom, base, b0, a1, a2, st)
            _set_scales(st, x0, mode, unbiased, rtol, eps, mean, inv)
            _row_scales(rows, neg, base, a1, a2, mean, inv, g, k)
        if write:
            _write(H, M, rows, neg, c, eps, tol, g, k, n, last, fwd, bwd, lam, out, rdiag)
