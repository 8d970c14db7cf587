"""GTPO-token's compiled CPU kernel: Eq. 3, 5, 6 of Tan et al., arXiv 2508.04349, as loops over rows and positions.

The definition is :func:`gtpo.algorithms.gtpo_token.gtpo_token_reference` (float64 torch); this numba kernel computes
the same advantages and diagnostics, tested against it, reading the entropy twice and writing each output once, in
memory beyond its inputs and outputs of ``O(L)`` per thread.

Notation. Per polarity q (correct rows: ``v = max(H, 0)``, sign ``s = +1``; incorrect rows: ``v = 1/(max(H, 0) + eps)``,
``s = -1``) and weight scope (the whole batch, or one prompt group), ``cnt_t`` counts the rows active at position t
and ``S_t = sum_i v_{i,t}``. Then

    c_t     = cnt_t / (S_t + eps)             the count-scaled share of Eq. 3 / Eq. 5: w_{i,t} = c_t v_{i,t}
    x_{i,t} = a1 b_i + s a2 c_t v_{i,t}       the shaped reward r~ (b_i: the base, GROP offset included)

Pass 1 (:func:`_scan`) accumulates per position ``cnt_t``, ``S_t``, ``Q_t = sum v^2`` and ``BV_t = sum (b_i - b0) v``
(only rows whose base differs from the polarity's first base ``b0``), and per row the valid count ``n_i``, the last
valid column and the raw entropy sum, with the input checks. Every set statistic of Eq. 6 follows in closed form;
with the shift ``x0 = a1 b0 + s a2`` (the polarity's mean when the shares are uniform, so near-constant sets are
measured, not cancelled):

    sum (x - x0)   = a1 sum_i (b_i - b0) n_i + s a2 sum_t (c_t S_t - cnt_t)
    sum (x - x0)^2 = a1^2 sum_i (b_i - b0)^2 n_i + 2 s a1 a2 (sum_t c_t BV_t - sum_i (b_i - b0) n_i)
                     + a2^2 sum_t (c_t^2 Q_t - 2 c_t S_t + cnt_t)

and from them each polarity's count, mean and centred second moment, combined per ``norm_mode``
(:func:`_set_scales`): ``split`` keeps each polarity's own, ``joint`` pools both, ``zero_fill`` adds the other
polarity's tokens as zeros. ``mean |x|`` (the zero-variance rule) is ``s * sum x`` on rows whose shaped rewards keep
one sign and is read token by token on the rare rows whose base has the other sign (:func:`_moments`).

Pass 2 (:func:`_write`) writes ``adv = g_i + k_i c_t v_{i,t}`` with ``g_i = (a1 b_i - mean) / (std + eps)`` and
``k_i = s a2 / (std + eps)`` of the row's set (0 when the set is constant), times the conflict weights of
``conflict_mask``, and the per-row sums the diagnostics need.

Group scopes (``weight_scope`` or ``norm_scope = "group"``) visit the rows group by group (:func:`_group_sweep`): the
group's rows are read once from memory and again from cache for their per-row sums and their advantages; only
``norm_scope="batch"`` with ``weight_scope="group"`` needs two visits (statistics, then advantages).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit
from numba.core.errors import NumbaError

from gtpo.algorithms.entropy_shaping import check_token_values
from gtpo.algorithms.kernel_support import (
    JIT_OPTIONS,
    as_numpy_mask,
    compile_timer,
    num_threads,
    row_shares,
    run_threads,
    zeroed_output,
)

__all__ = ["gtpo_token_kernel", "CompileError"]

CompileError = NumbaError

_MODES = {"zero_fill": 0, "joint": 1, "split": 2}
_ZERO_FILL, _JOINT, _SPLIT = 0, 1, 2


# --------------------------------------------------------------------------------------------------------------------
# rows


@njit(**JIT_OPTIONS)
def _mask_row(m_row):
    """``(valid count, last valid column or -1, valid values other than 1)`` of one mask row."""
    count = 0
    last = -1
    bad = 0
    for t in range(m_row.shape[0]):
        valid = m_row[t] != 0
        count += valid
        bad += valid and m_row[t] != 1
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
    for i in rows:
        count, lst, bad = _mask_row(M[i])
        n[i] = count
        last[i] = lst
        err[0] += bad
        top = max(top, lst)
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
def _emit(v, c, g, k, stop, o):
    """``o[t] = g + k c_t v_t`` for ``t < stop``; returns ``(sum, sum |.|, #> 0, #< 0)`` of what it wrote."""
    total = 0.0
    size = 0.0
    pos = 0
    negs = 0
    for t in range(stop):
        a = g + k * c[t] * v[t]
        o[t] = a
        total += a
        size += abs(a)
        pos += a > 0.0
        negs += a < 0.0
    return total, size, pos, negs


@njit(**JIT_OPTIONS)
def _write(H, M, rows, neg, c, eps, tol, g, k, n, last, fwd, bwd, lam, out, rdiag):
    """Pass 2: ``adv = (g_i + k_i c_t v_t) * lambda_{i,t}`` on the valid tokens (padding keeps its zeros).

    ``lambda`` is ``lam[i]`` on the first ``fwd[i]`` and the last ``bwd[i]`` valid columns (the conflict runs), 1
    elsewhere. ``rdiag[i] = (sum adv, sum |adv|, #adv > 0, #adv < 0)``.
    """
    v = np.empty(H.shape[1])
    for i in rows:
        lst = last[i]
        if lst < 0:
            continue
        dense = n[i] == lst + 1
        q = 1 if neg[i] else 0
        _values(H[i], M[i], lst + 1, dense, q == 1, eps, tol, v)
        cq = c[q]
        gi = g[i]
        ki = k[i]
        if dense and fwd[i] == 0 and bwd[i] == 0:  # the common row: one loop from v to the output
            total, size, pos, negs = _emit(v, cq, gi, ki, lst + 1, out[i])
        else:
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
            total, size, pos, negs = _emit(v, np.ones(lst + 1), 0.0, 1.0, lst + 1, out[i])
        rdiag[i, 0] = total
        rdiag[i, 1] = size
        rdiag[i, 2] = pos
        rdiag[i, 3] = negs


# --------------------------------------------------------------------------------------------------------------------
# sets (Eq. 6)


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


# --------------------------------------------------------------------------------------------------------------------
# the estimator


def gtpo_token_kernel(entropy, response_mask, correct, base, gid, num_groups, params, responses=None):
    """GTPO-token advantages and diagnostics on CPU tensors (validated by the caller).

    Args:
        entropy: ``[B, L]`` float entropy. response_mask: ``[B, L]`` 0/1 (bool, integer or float).
        correct: ``[B]`` bool. base: ``[B]`` float64 bases (``shaping_bases``: reward or -1, plus the GROP offset).
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: ``GTPOParams``.
        responses: ``[B, L]`` token ids when ``params.conflict_mask``.

    Returns:
        ``(advantages [B, L] float32, diagnostics)``; ``kernel_compile_s`` is among the diagnostics on a
        call that compiled (or loaded from the disk cache) the kernel.

    Raises:
        ValueError: the precise message of :func:`gtpo.algorithms.entropy_shaping.check_token_values` on bad token
            values. ``CompileError`` when numba cannot compile the kernel (the caller falls back to the definition).
    """
    with compile_timer() as timer:
        outputs = _gtpo_token(entropy, response_mask, correct, base, gid, num_groups, params, responses)
    if timer.seconds > 0:
        outputs[-1]["kernel_compile_s"] = timer.seconds
    return outputs


class _Batch:
    """The numpy views, knobs and per-row arrays one call of the kernel shares between its passes."""

    def __init__(self, entropy, response_mask, correct, base, gid, num_groups, params):
        self.entropy, self.response_mask, self.params = entropy, response_mask, params
        # float32 / float64 entropy is read as it is, other float types as float32
        h = entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()
        self.H = h.detach().contiguous().numpy()
        self.M = as_numpy_mask(response_mask)
        b, length = self.H.shape
        self.rows, self.length, self.num_groups = b, length, num_groups
        self.neg = (~correct).numpy()
        self.base = base.to(torch.float64).numpy()
        self.gid = gid.to(torch.long).numpy()
        self.eps, self.tol = float(params.eps), float(params.neg_entropy_tol)
        self.a1, self.a2 = float(params.alpha1), float(params.alpha2)
        self.jit = (self.eps, self.tol, self.a1, self.a2, _MODES[params.norm_mode], params.std == "unbiased",
                    float(params.zero_var_rtol))  # fmt: skip
        self.sign = np.where(self.neg, -1.0, 1.0)
        # b0: each polarity's first base; x0 = a1 b0 + s a2, its shaped reward when every share is 1
        pos = ~self.neg
        self.b0 = np.array([self.base[pos][0] if pos.any() else 0.0, self.base[self.neg][0] if self.neg.any() else 0.0])
        self.x0 = self.a1 * self.b0 + np.array([self.a2, -self.a2])
        self.ebase = self.base - self.b0[self.neg.astype(np.int64)]
        self.n, self.last = np.zeros(b, np.int64), np.full(b, -1, np.int64)
        self.hsum, self.mom, self.rdiag = np.zeros(b), np.zeros((b, 3)), np.zeros((b, 4))
        self.g, self.k = np.zeros(b), np.zeros(b)
        self.fwd, self.bwd = np.zeros(b, np.int64), np.zeros(b, np.int64)
        self.lam = np.where(self.neg, float(params.conflict_lam_neg), float(params.conflict_lam_pos))
        self.out = zeroed_output(b, length)
        self.threads = num_threads(b)
        self.diag: dict[str, float] = {}

    def check(self, errs) -> None:
        """Raise the definition's precise error if pass 1 counted a bad mask value or entropy."""
        if errs.any():
            check_token_values(self.entropy, self.response_mask, self.tol)
            raise ValueError("entropy / response_mask failed a consistency check")  # pragma: no cover

    def conflict_runs(self, responses) -> None:
        """``conflict_mask``: GTPO-trajectory's conflict runs with correctness as the polarity (needs ``last``)."""
        from gtpo.algorithms.trajectory_kernel import conflict_runs

        polarity = np.where(self.neg, -1, 1).astype(np.int8) * (self.n > 0)
        self.fwd[:], self.bwd[:] = conflict_runs(responses, self.M, self.gid, self.num_groups, polarity, self.last)
        overlap = np.maximum(self.fwd + self.bwd - (self.last + 1), 0)
        conflict = (self.fwd + self.bwd - overlap).sum()
        self.diag["conflict_token_frac"] = float(conflict) / max(int(self.n.sum()), 1)

    def set_scales(self, st) -> None:
        """Eq. 6 from the polarities' sums ``st``: every row's ``g`` / ``k``."""
        mean, inv = np.zeros(2), np.zeros(2)
        _set_scales(st, self.x0, *self.jit[4:], self.eps, mean, inv)
        _row_scales(np.arange(self.rows), self.neg, self.base, self.a1, self.a2, mean, inv, self.g, self.k)


def _gtpo_token(entropy, response_mask, correct, base, gid, num_groups, params, responses):
    bt = _Batch(entropy, response_mask, correct, base, gid, num_groups, params)
    if params.weight_scope == "batch":
        c, acc, tops = _batch_weights(bt)
        if params.conflict_mask:
            bt.conflict_runs(responses)
        weights = ((c * acc[:, 1]).sum(-1), (c * c * acc[:, 2]).sum(-1), tops[1:], tops[0])
        if params.norm_scope == "batch":
            shaped = _closed_form(bt, c, acc)
            jobs = [(bt.H, bt.M, np.arange(lo, hi), bt.neg, c, bt.eps, bt.tol, bt.g, bt.k, bt.n, bt.last, bt.fwd,
                     bt.bwd, bt.lam, bt.out.numpy(), bt.rdiag)
                    for lo, hi in row_shares(bt.rows, bt.threads)]  # fmt: skip
            run_threads(_write, jobs)  # pass 2
        else:
            shaped, _ = _group_scopes(bt, c, responses)
    else:
        shaped, weights = _group_scopes(bt, None, responses)
    bt.diag.update(_diagnostics(params, correct.numpy(), gid.numpy(), num_groups, bt.n, bt.hsum, bt.rdiag, shaped,
                                *weights))  # fmt: skip
    return bt.out, bt.diag


def _batch_weights(bt):
    """Pass 1 over every row (``weight_scope="batch"``), split over threads: ``c [2, L]``, the summed ``acc`` and
    ``(conservation error, largest weight of each polarity)``."""
    length = bt.length
    shares = row_shares(bt.rows, bt.threads)
    parts = [(np.zeros((2, 5, length)), np.zeros((2, length + 1)), np.zeros(3, np.int64)) for _ in shares]
    jobs = [(bt.H, bt.M, np.arange(lo, hi), bt.neg, bt.ebase, bt.eps, bt.tol, acc, hist, bt.n, bt.last, bt.hsum, err)
            for (lo, hi), (acc, hist, err) in zip(shares, parts)]  # fmt: skip
    run_threads(_scan, jobs)
    bt.check(sum(err for _, _, err in parts))
    acc = sum(a for a, _, _ in parts)
    acc[:, 4] = np.max([a[:, 4] for a, _, _ in parts], axis=0)  # the per-position maxima combine by max
    hist = sum(h for _, h, _ in parts)
    c, tops = np.zeros((2, length)), np.zeros(3)
    _coefficients(acc, hist, length, bt.eps, bt.a2, c, tops)
    return c, acc, tops


def _closed_form(bt, c, acc):
    """Eq. 6 at batch scopes from the per-position sums (module docstring): sets every row's ``g`` / ``k``;
    returns the polarities' sums of shaped rewards."""
    a1, a2, ebase, n = bt.a1, bt.a2, bt.ebase, bt.n
    st = np.zeros((2, 4))  # per polarity: tokens, sum (x - x0), sum (x - x0)^2, sum |x|
    for q, s in ((0, 1.0), (1, -1.0)):
        rows = bt.neg == bool(q)
        e, nq = ebase[rows], n[rows]
        cnt, s_t, q_t, bv = acc[q, :4]
        st[q, 0] = nq.sum()
        st[q, 1] = a1 * (e * nq).sum() + s * a2 * (c[q] * s_t - cnt).sum()
        st[q, 2] = (a1 * a1 * (e * e * nq).sum() + 2 * s * a1 * a2 * ((c[q] * bv).sum() - (e * nq).sum())
                    + a2 * a2 * (c[q] * c[q] * q_t - 2 * c[q] * s_t + cnt).sum())  # fmt: skip
    shaped = st[:, 0] * bt.x0 + st[:, 1]
    # mean|x| = s * sum x, except on rows whose base has the other sign than s: there token by token
    st[0, 3], st[1, 3] = shaped[0], -shaped[1]
    mixed = np.nonzero((a1 * bt.base * bt.sign < 0) & (n > 0))[0]
    if mixed.size:
        _moments(bt.H, bt.M, mixed, bt.neg, c, bt.eps, bt.tol, a1, a2, bt.base, n, bt.last, bt.mom)
        for q, s in ((0, 1.0), (1, -1.0)):
            rows = mixed[bt.neg[mixed] == bool(q)]
            x_mixed = (n[rows] * bt.x0[q] + a1 * ebase[rows] * n[rows] + s * a2 * bt.mom[rows, 0]).sum()
            st[q, 3] += bt.mom[rows, 2].sum() - s * x_mixed
    bt.set_scales(st)
    return shaped


def _group_scopes(bt, c_batch, responses):
    """``norm_scope`` or ``weight_scope`` = ``"group"``: the rows group by group (:func:`_group_sweep`).

    ``c_batch``: the batch weights (``weight_scope="batch"``), else None (per-group weights). Returns the
    polarities' sums of shaped rewards and, for per-group weights, the weight diagnostics' sums.
    """
    b, num_groups = bt.rows, bt.num_groups
    order = np.argsort(bt.gid, kind="stable")
    gptr = np.concatenate([[0], np.cumsum(np.bincount(bt.gid, minlength=num_groups))]).astype(np.int64)
    by_group = c_batch is None
    c_batch = np.zeros((2, bt.length)) if by_group else c_batch
    per_group = np.zeros((num_groups, 3))  # conservation error, largest weight of each polarity
    shares = row_shares(num_groups, bt.threads)
    errs = [np.zeros(3, np.int64) for _ in shares]

    def sweep(write):
        run_threads(_group_sweep, [
            (bt.H, bt.M, order, gptr, np.arange(lo, hi), bt.neg, bt.ebase, bt.base, bt.b0, bt.x0, bt.jit, c_batch,
             by_group, write, bt.n, bt.last, bt.hsum, errs[t], bt.mom, per_group, bt.g, bt.k, bt.fwd, bt.bwd, bt.lam,
             bt.out.numpy(), bt.rdiag)
            for t, (lo, hi) in enumerate(shares)])  # fmt: skip

    if by_group and bt.params.conflict_mask:
        _mask_rows(bt.M, np.arange(b), bt.n, bt.last)  # the conflict runs need each row's last column first
        bt.conflict_runs(responses)
    if bt.params.norm_scope == "batch":
        sweep(0)  # per-group weights, batch statistics: every row's moments before any row is written
        bt.check(sum(errs))
        st = np.zeros((2, 4))
        _add_rows(np.arange(b), bt.neg, bt.n, bt.mom, bt.base, bt.b0, bt.a1, bt.a2, st)
        bt.set_scales(st)
        sweep(2)
    else:
        sweep(1)
        bt.check(sum(errs))
    d, d2, n, neg = bt.mom[:, 0], bt.mom[:, 1], bt.n, bt.neg
    rows_x = n * bt.x0[neg.astype(np.int64)] + bt.a1 * bt.ebase * n + bt.sign * bt.a2 * d
    shaped = np.array([rows_x[~neg].sum(), rows_x[neg].sum()])
    w, w2 = d + n, d2 + 2 * d + n  # per row: sum w and sum w^2 from sum (w - 1) and sum (w - 1)^2
    weights = (
        np.array([w[~neg].sum(), w[neg].sum()]),
        np.array([w2[~neg].sum(), w2[neg].sum()]),
        per_group[:, 1:].max(0) if num_groups else np.zeros(2),
        float(per_group[:, 0].max()) if num_groups else 0.0,
    )
    return shaped, weights


def _diagnostics(params, correct, gid, num_groups, n, hsum, rdiag, shaped, w_sum, w_sq, w_max, cons) -> dict:
    """The ``gtpo/...`` diagnostics from per-row and per-polarity sums."""

    def ratio(num, den):
        return float(num) / float(den) if den > 0 else 0.0

    a2 = float(params.alpha2)
    out: dict[str, float] = {}
    tokens = [n[correct].sum(), n[~correct].sum()]
    for q, name in enumerate(("pos", "neg")):
        mean = ratio(w_sum[q], tokens[q]) if a2 > 0 else 0.0
        sq = ratio(w_sq[q], tokens[q]) if a2 > 0 else 0.0
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(max(sq - mean * mean, 0.0))
        out[f"weight_{name}_max"] = float(w_max[q]) if a2 > 0 else 0.0
    total, size, pos, negs = rdiag[:, 0], rdiag[:, 1], rdiag[:, 2], rdiag[:, 3]
    n_all = n.sum()
    nonempty = n > 0
    rows_per_group = np.bincount(gid[nonempty], minlength=num_groups)
    correct_per_group = np.bincount(gid[nonempty & correct], minlength=num_groups)
    live = rows_per_group > 0
    out.update(
        {
            "shaped_correct_mean": ratio(shaped[0], tokens[0]),
            "shaped_incorrect_mean": ratio(shaped[1], tokens[1]),
            "adv_correct_mean": ratio(total[correct].sum(), tokens[0]),
            "adv_incorrect_mean": ratio(total[~correct].sum(), tokens[1]),
            "adv_pos_mean": ratio((size + total).sum() / 2, pos.sum()),
            "adv_neg_mean": ratio((total - size).sum() / 2, negs.sum()),
            "adv_abs_mean": ratio(size.sum(), n_all),
            "frac_tokens_adv_pos": ratio(pos.sum(), n_all),
            "frac_tokens_adv_neg": ratio(negs.sum(), n_all),
            "conservation_err": float(cons),
            "frac_groups_all_correct": ratio((live & (correct_per_group == rows_per_group)).sum(), live.sum()),
            "frac_groups_all_wrong": ratio((live & (correct_per_group == 0)).sum(), live.sum()),
            "entropy_correct_mean": ratio(hsum[correct].sum(), tokens[0]),
            "entropy_incorrect_mean": ratio(hsum[~correct].sum(), tokens[1]),
        }
    )
    return out
