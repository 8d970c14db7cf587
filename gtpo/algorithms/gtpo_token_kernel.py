"""GTPO-token's compiled CPU kernel: Eq. 3, 5, 6 of Tan et al., arXiv 2508.04349, as loops over rows and positions.

The definition is :func:`gtpo.algorithms.gtpo_token.gtpo_token_reference` (float64 torch); this numba kernel computes
the same advantages and diagnostics, tested against it, reading the entropy twice and writing each output once, in
memory beyond its inputs and outputs of ``O(L)`` per thread.

Notation. Per polarity q (correct rows: ``v = max(H, 0)``, sign ``s = +1``; incorrect rows: ``v = 1/(max(H, 0) + eps)``,
``s = -1``) and weight scope (the whole batch, or one prompt group), ``cnt_t`` counts the rows active at position t
and ``S_t = sum_i v_{i,t}``. Then

    c_t     = cnt_t / (S_t + eps)             the count-scaled share of Eq. 3 / Eq. 5: w_{i,t} = c_t v_{i,t}
    x_{i,t} = a1 b_i + s a2 c_t v_{i,t}       the shaped reward r~ (b_i: the base, GROP offset included)

Pass 1 (``_scan``) accumulates per position ``cnt_t``, ``S_t``, ``Q_t = sum v^2`` and ``BV_t = sum (b_i - b0) v``
(only rows whose base differs from the polarity's first base ``b0``), and per row the valid count ``n_i``, the last
valid column and the raw entropy sum, with the input checks. Every set statistic of Eq. 6 follows in closed form;
with the shift ``x0 = a1 b0 + s a2`` (the polarity's mean when the shares are uniform, so near-constant sets are
measured, not cancelled):

    sum (x - x0)   = a1 sum_i (b_i - b0) n_i + s a2 sum_t (c_t S_t - cnt_t)
    sum (x - x0)^2 = a1^2 sum_i (b_i - b0)^2 n_i + 2 s a1 a2 (sum_t c_t BV_t - sum_i (b_i - b0) n_i)
                     + a2^2 sum_t (c_t^2 Q_t - 2 c_t S_t + cnt_t)

and from them each polarity's count, mean and centred second moment, combined per ``norm_mode``
(``_set_scales``): ``split`` keeps each polarity's own, ``joint`` pools both, ``zero_fill`` adds the other
polarity's tokens as zeros. ``mean |x|`` (the zero-variance rule) is ``s * sum x`` on rows whose shaped rewards keep
one sign and is read token by token on the rare rows whose base has the other sign (``_moments``).

Pass 2 (``_write``) writes ``adv = g_i + k_i c_t v_{i,t}`` with ``g_i = (a1 b_i - mean) / (std + eps)`` and
``k_i = s a2 / (std + eps)`` of the row's set (0 when the set is constant), times the conflict weights of
``conflict_mask``, and the per-row sums the diagnostics need.

Group scopes (``weight_scope`` or ``norm_scope = "group"``) visit the rows group by group (``_group_sweep``): the
group's rows are read once from memory and again from cache for their per-row sums and their advantages; only
``norm_scope="batch"`` with ``weight_scope="group"`` needs two visits (statistics, then advantages).

This module is the entry and the batch-scope pass 1. The loops over rows (``_scan``, ``_moments``, ``_write``) and
Eq. 6's compiled parts (``_set_scales``, ``_group_sweep``) are :mod:`gtpo.algorithms.gtpo_token_passes`; Eq. 6's
Python side (``_closed_form``, the group scopes) is :mod:`gtpo.algorithms.gtpo_token_sets`. Deviations from the
paper are the recipe's knobs (:mod:`gtpo.algorithms.shaping_params`); the kernel adds none: it is tested against the
float64 definition.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba.core.errors import NumbaError

from gtpo.algorithms.gtpo_token_passes import _coefficients, _row_scales, _scan, _set_scales, _write
from gtpo.algorithms.gtpo_token_sets import _closed_form, _group_scopes
from gtpo.algorithms.kernel_support import (
    as_numpy_mask,
    compile_timer,
    kernel_output,
    num_threads,
    run_blocks,
)
from gtpo.algorithms.shaping_inputs import check_token_values

__all__ = ["gtpo_token_kernel", "CompileError"]

CompileError = NumbaError

_MODES = {"zero_fill": 0, "joint": 1, "split": 2}


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
        ValueError: the precise message of :func:`gtpo.algorithms.shaping_inputs.check_token_values` on bad token
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
        self.out = kernel_output(b, length)
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
            out = bt.out.numpy()
            jobs = lambda lo, hi, w: (bt.H, bt.M, np.arange(lo, hi), bt.neg, c, bt.eps, bt.tol, bt.g, bt.k, bt.n,  # noqa: E731
                                      bt.last, bt.fwd, bt.bwd, bt.lam, out, bt.rdiag)  # fmt: skip
            run_blocks(_write, bt.rows, bt.threads, jobs, bt.n)  # pass 2
        else:
            shaped, _ = _group_scopes(bt, c, responses)
    else:
        shaped, weights = _group_scopes(bt, None, responses)
    bt.diag.update(_diagnostics(params, correct.numpy(), gid.numpy(), num_groups, bt.n, bt.hsum, bt.rdiag, shaped,
                                *weights))  # fmt: skip
    return bt.out, bt.diag


def _batch_weights(bt):
    """Pass 1 over every row (``weight_scope="batch"``), blocks of rows over the threads, each thread with its own
    partial sums: ``c [2, L]``, the summed ``acc`` and ``(conservation error, largest weight of each polarity)``."""
    length = bt.length
    parts = [(np.zeros((2, 5, length)), np.zeros((2, length + 1)), np.zeros(3, np.int64)) for _ in range(bt.threads)]
    run_blocks(_scan, bt.rows, bt.threads, lambda lo, hi, w: (
        bt.H, bt.M, np.arange(lo, hi), bt.neg, bt.ebase, bt.eps, bt.tol, *parts[w][:2], bt.n, bt.last, bt.hsum,
        parts[w][2]))  # fmt: skip
    bt.check(sum(err for _, _, err in parts))
    acc, hist = parts[0][0], parts[0][1]
    for a, h, _ in parts[1:]:  # the threads' partial sums, reduced once (the per-position maxima by max)
        acc[:, :4] += a[:, :4]
        np.maximum(acc[:, 4], a[:, 4], out=acc[:, 4])
        hist += h
    c, tops = np.zeros((2, length)), np.zeros(3)
    _coefficients(acc, hist, length, bt.eps, bt.a2, c, tops)
    return c, acc, tops


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
