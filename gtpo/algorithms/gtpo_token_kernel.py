"""GTPO-token's compiled CPU kernel: Eq. 3, 5, 6 of Tan et al., arXiv 2508.04349, as loops over rows and positions.

The definition is :func:`gtpo.algorithms.gtpo_token.gtpo_token_reference` (float64 torch); this numba kernel computes
the same advantages and diagnostics, tested against it, reading the entropy twice and writing each output once, in
memory beyond its inputs and outputs of ``O(L)`` per thread.

Notation. Per polarity q (correct rows: ``v = max(H, 0)``, sign ``s = +1``; incorrect rows: ``v = 1/(max(H, 0) + eps)``,
``s = -1``) and weight scope (the whole batch, or one prompt group), ``cnt_t`` counts the rows active at position t
and ``S_t = sum_i v_{i,t}``. Then

    c_t     = cnt_t / (S_t + eps)             the count-scaled share of Eq. 3 / Eq. 5: w_{i,t} = c_t v_{i,t}
    x_{i,t} = a1 b_i + s a2 c_t v_{i,t}       the shaped reward r~ (b_i: the base, GROP offset included)

Pass 1 (``scan``) accumulates per position ``cnt_t``, ``S_t``, ``Q_t = sum v^2`` and ``BV_t = sum (b_i - b0) v``
(only rows whose base differs from the polarity's first base ``b0``), and per row the valid count ``n_i``, the last
valid column and the raw entropy sum, with the input checks. Every set statistic of Eq. 6 follows in closed form;
with the shift ``x0 = a1 b0 + s a2`` (the polarity's mean when the shares are uniform, so near-constant sets are
measured, not cancelled):

    sum (x - x0)   = a1 sum_i (b_i - b0) n_i + s a2 sum_t (c_t S_t - cnt_t)
    sum (x - x0)^2 = a1^2 sum_i (b_i - b0)^2 n_i + 2 s a1 a2 (sum_t c_t BV_t - sum_i (b_i - b0) n_i)
                     + a2^2 sum_t (c_t^2 Q_t - 2 c_t S_t + cnt_t)

and from them each polarity's count, mean and centred second moment, combined per ``norm_mode``
(``set_scales``): ``split`` keeps each polarity's own, ``joint`` pools both, ``zero_fill`` adds the other
polarity's tokens as zeros. ``mean |x|`` (the zero-variance rule) is ``s * sum x`` on rows whose shaped rewards keep
one sign and is read token by token on the rare rows whose base has the other sign (``moments``).

Pass 2 (``write``) writes ``adv = g_i + k_i c_t v_{i,t}`` with ``g_i = (a1 b_i - mean) / (std + eps)`` and
``k_i = s a2 / (std + eps)`` of the row's set (0 when the set is constant), times the conflict weights of
``conflict_mask``, and the per-row sums the diagnostics need.

Group scopes (``weight_scope`` or ``norm_scope = "group"``) visit the rows group by group (``group_sweep``): the
group's rows are read once from memory and again from cache for their per-row sums and their advantages; only
``norm_scope="batch"`` with ``weight_scope="group"`` needs two visits (statistics, then advantages).

This module is the Python side: the entry, the batch state (:class:`_Batch`, one method per pass), Eq. 6's closed
form and the group scopes. Every compiled loop is :mod:`gtpo.algorithms.gtpo_token_passes` (one file, because numba's
disk cache keys a compiled function on its own file: a caller in another file would keep a stale copy of an edited
callee); the conflict runs of ``conflict_mask`` are :mod:`gtpo.algorithms.conflict_runs_kernel`. Deviations from the
paper are the recipe's knobs (:mod:`gtpo.algorithms.shaping_params`); the kernel adds none: it is tested against the
float64 definition.

Names (the kernel's arrays, with the symbols above and those of :mod:`gtpo.algorithms.gtpo_token`):

    entropy [B, L]      H_{i,t}                      mask [B, L]          response_mask (valid tokens)
    incorrect [B]       i in O- (else O+)            base [B]             b_i (reward or -1, GROP offset included)
    group_of_row [B]    the prompt group of row i    first_base [2]       b0 of each polarity
    shift [2]           x0 = a1 b0 + s a2            base_dev [B]         b_i - b0
    coef [2, L]         c_t of each polarity         sums [2, 5, L]       (cnt_t, S_t, Q_t, BV_t, max v) per polarity
    dense_hist [2, L+1] dense rows per length n_i    n_valid, last [B]    n_i, the last valid column
    entropy_sum [B]     sum_t H_{i,t} (valid t)      row_moments [B, 3]   sum (w-1), sum (w-1)^2, sum |x| (w = c_t v)
    intercept [B]       g_i                          slope [B]            k_i
    run_fwd, run_bwd    f_i, b_i: conflict runs      conflict_lam [B]     lambda of a conflict token
    set_sums [2, 4]     tokens, sum (x-x0), sum (x-x0)^2, sum |x|
    alpha1, alpha2      a1, a2 (alpha_1, alpha_2)    cnt_t                d_t (O+) / h_t (O-) of Eq. 3 / Eq. 5
    row_stats [B, 4]    sum adv, sum |adv|, #adv > 0, #adv < 0 (the diagnostics)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gtpo.algorithms.conflict_runs_kernel import conflict_runs
from gtpo.algorithms.gtpo_token_passes import (
    add_rows,
    coefficients,
    group_sweep,
    mask_rows,
    moments,
    row_scales,
    scan,
    set_scales,
    write,
)
from gtpo.algorithms.kernel_support import (
    as_numpy_mask,
    compile_timer,
    kernel_output,
    num_threads,
    row_shares,
    run_blocks,
    run_threads,
)
from gtpo.algorithms.shaping_inputs import check_token_values

__all__ = ["gtpo_token_kernel"]

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
            values. A numba error when numba cannot compile the kernel (the caller falls back to the definition).
    """
    with compile_timer() as timer:
        outputs = _gtpo_token(entropy, response_mask, correct, base, gid, num_groups, params, responses)
    if timer.seconds > 0:
        outputs[-1]["kernel_compile_s"] = timer.seconds
    return outputs


def _gtpo_token(entropy, response_mask, correct, base, gid, num_groups, params, responses):
    bt = _Batch(entropy, response_mask, correct, base, gid, num_groups, params)
    if params.weight_scope == "batch":
        coef, sums, tops = bt.batch_weights()  # pass 1
        if params.conflict_mask:
            bt.conflict_runs(responses)
        weights = ((coef * sums[:, 1]).sum(-1), (coef * coef * sums[:, 2]).sum(-1), tops[1:], tops[0])
        if params.norm_scope == "batch":
            shaped = bt.closed_form(coef, sums)
            bt.write(coef)  # pass 2
        else:
            shaped, _ = bt.group_scopes(coef, responses)
    else:
        shaped, weights = bt.group_scopes(None, responses)
    bt.diag.update(_diagnostics(params, correct.numpy(), bt.group_of_row, num_groups, bt.n_valid, bt.entropy_sum,
                                bt.row_stats, shaped, *weights))  # fmt: skip
    return bt.out, bt.diag


class _Batch:
    """The numpy views, knobs and per-row arrays of one call (names: the module docstring), and its passes."""

    def __init__(self, entropy, response_mask, correct, base, gid, num_groups, params):
        self.inputs, self.params = (entropy, response_mask), params
        # float32 / float64 entropy is read as it is, other float types as float32
        values = entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()
        self.entropy = values.detach().contiguous().numpy()
        self.mask = as_numpy_mask(response_mask)
        b, length = self.entropy.shape
        self.rows, self.length, self.num_groups = b, length, num_groups
        self.incorrect = (~correct).numpy()
        self.base = base.to(torch.float64).numpy()
        self.group_of_row = gid.to(torch.long).numpy()
        self.eps, self.tol = float(params.eps), float(params.neg_entropy_tol)
        self.alpha1, self.alpha2 = float(params.alpha1), float(params.alpha2)
        self.knobs = (self.eps, self.tol, self.alpha1, self.alpha2, _MODES[params.norm_mode], params.std == "unbiased",
                      float(params.zero_var_rtol))  # fmt: skip
        self.sign = np.where(self.incorrect, -1.0, 1.0)
        # b0: each polarity's first base; x0 = a1 b0 + s a2, its shaped reward when every share is 1
        neg, pos = self.incorrect, ~self.incorrect
        self.first_base = np.array([self.base[pos][0] if pos.any() else 0.0, self.base[neg][0] if neg.any() else 0.0])
        self.shift = self.alpha1 * self.first_base + np.array([self.alpha2, -self.alpha2])
        self.base_dev = self.base - self.first_base[neg.astype(np.int64)]
        self.n_valid, self.last = np.zeros(b, np.int64), np.full(b, -1, np.int64)
        self.entropy_sum, self.row_moments, self.row_stats = np.zeros(b), np.zeros((b, 3)), np.zeros((b, 4))
        self.intercept, self.slope = np.zeros(b), np.zeros(b)
        self.run_fwd, self.run_bwd = np.zeros(b, np.int64), np.zeros(b, np.int64)
        self.conflict_lam = np.where(neg, float(params.conflict_lam_neg), float(params.conflict_lam_pos))
        self.out = kernel_output(b, length)
        self.threads = num_threads(b)
        self.diag: dict[str, float] = {}

    def check(self, errors) -> None:
        """Raise the definition's precise error if pass 1 counted a bad mask value or entropy."""
        if errors.any():
            check_token_values(*self.inputs, self.tol)
            raise ValueError("entropy / response_mask failed a consistency check")  # pragma: no cover

    def batch_weights(self):
        """Pass 1 over every row (``weight_scope="batch"``), blocks of rows over the threads, each thread with its
        own partial sums: ``coef [2, L]``, the summed ``sums`` and ``(conservation error, largest weight of each
        polarity)``."""
        length = self.length
        parts = [(np.zeros((2, 5, length)), np.zeros((2, length + 1)), np.zeros(3, np.int64))
                 for _ in range(self.threads)]  # fmt: skip
        run_blocks(scan, self.rows, self.threads, lambda lo, hi, w: (
            self.entropy, self.mask, np.arange(lo, hi), self.incorrect, self.base_dev, self.eps, self.tol,
            *parts[w][:2], self.n_valid, self.last, self.entropy_sum, parts[w][2]))  # fmt: skip
        self.check(sum(errors for _, _, errors in parts))
        sums, dense_hist = parts[0][0], parts[0][1]
        for s, h, _ in parts[1:]:  # the threads' partial sums, reduced once (the per-position maxima by max)
            sums[:, :4] += s[:, :4]
            np.maximum(sums[:, 4], s[:, 4], out=sums[:, 4])
            dense_hist += h
        coef, tops = np.zeros((2, length)), np.zeros(3)
        coefficients(sums, dense_hist, length, self.eps, self.alpha2, coef, tops)
        return coef, sums, tops

    def conflict_runs(self, responses) -> None:
        """``conflict_mask``: GTPO-trajectory's conflict runs with correctness as the polarity (needs ``last``)."""
        polarity = np.where(self.incorrect, -1, 1).astype(np.int8) * (self.n_valid > 0)
        self.run_fwd[:], self.run_bwd[:] = conflict_runs(responses, self.mask, self.group_of_row, self.num_groups,
                                                         polarity, self.last)  # fmt: skip
        overlap = np.maximum(self.run_fwd + self.run_bwd - (self.last + 1), 0)
        conflict = (self.run_fwd + self.run_bwd - overlap).sum()
        self.diag["conflict_token_frac"] = float(conflict) / max(int(self.n_valid.sum()), 1)

    def set_scales(self, set_sums) -> None:
        """Eq. 6 from the polarities' sums ``set_sums``: every row's ``intercept`` / ``slope``."""
        mean, inv = np.zeros(2), np.zeros(2)
        set_scales(set_sums, self.shift, *self.knobs[4:], self.eps, mean, inv)
        row_scales(np.arange(self.rows), self.incorrect, self.base, self.alpha1, self.alpha2, mean, inv,
                   self.intercept, self.slope)  # fmt: skip

    def closed_form(self, coef, sums):
        """Eq. 6 at batch scopes from the per-position sums (module docstring): sets every row's ``intercept`` /
        ``slope``; returns the polarities' sums of shaped rewards."""
        a1, a2, base_dev, n = self.alpha1, self.alpha2, self.base_dev, self.n_valid
        set_sums = np.zeros((2, 4))  # per polarity: tokens, sum (x - x0), sum (x - x0)^2, sum |x|
        for q, s in ((0, 1.0), (1, -1.0)):
            rows = self.incorrect == bool(q)
            e, nq = base_dev[rows], n[rows]
            cnt, s_t, q_t, bv = sums[q, :4]
            c = coef[q]
            set_sums[q, 0] = nq.sum()
            set_sums[q, 1] = a1 * (e * nq).sum() + s * a2 * (c * s_t - cnt).sum()
            set_sums[q, 2] = (a1 * a1 * (e * e * nq).sum() + 2 * s * a1 * a2 * ((c * bv).sum() - (e * nq).sum())
                              + a2 * a2 * (c * c * q_t - 2 * c * s_t + cnt).sum())  # fmt: skip
        shaped = set_sums[:, 0] * self.shift + set_sums[:, 1]
        # mean|x| = s * sum x, except on rows whose base has the other sign than s: there token by token
        set_sums[0, 3], set_sums[1, 3] = shaped[0], -shaped[1]
        mixed = np.nonzero((a1 * self.base * self.sign < 0) & (n > 0))[0]
        if mixed.size:
            moments(self.entropy, self.mask, mixed, self.incorrect, coef, self.eps, self.tol, a1, a2, self.base, n,
                    self.last, self.row_moments)  # fmt: skip
            for q, s in ((0, 1.0), (1, -1.0)):
                rows = mixed[self.incorrect[mixed] == bool(q)]
                x_mixed = (n[rows] * self.shift[q] + a1 * base_dev[rows] * n[rows]
                           + s * a2 * self.row_moments[rows, 0]).sum()  # fmt: skip
                set_sums[q, 3] += self.row_moments[rows, 2].sum() - s * x_mixed
        self.set_scales(set_sums)
        return shaped

    def write(self, coef) -> None:
        """Pass 2 over every row: the advantages into ``out``, the per-row sums into ``row_stats``."""
        out = self.out.numpy()
        run_blocks(write, self.rows, self.threads, lambda lo, hi, w: (
            self.entropy, self.mask, np.arange(lo, hi), self.incorrect, coef, self.eps, self.tol, self.intercept,
            self.slope, self.n_valid, self.last, self.run_fwd, self.run_bwd, self.conflict_lam, out, self.row_stats),
            self.n_valid)  # fmt: skip

    def group_scopes(self, coef_batch, responses):
        """``norm_scope`` or ``weight_scope`` = ``"group"``: the rows group by group (:func:`group_sweep`).

        ``coef_batch``: the batch weights (``weight_scope="batch"``), else None (per-group weights). Returns the
        polarities' sums of shaped rewards and, for per-group weights, the weight diagnostics' sums.
        """
        b, num_groups = self.rows, self.num_groups
        order = np.argsort(self.group_of_row, kind="stable")
        counts = np.bincount(self.group_of_row, minlength=num_groups)
        group_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        by_group = coef_batch is None
        coef_batch = np.zeros((2, self.length)) if by_group else coef_batch
        per_group = np.zeros((num_groups, 3))  # conservation error, largest weight of each polarity
        shares = row_shares(num_groups, self.threads)
        errors = [np.zeros(3, np.int64) for _ in shares]
        out = self.out.numpy()

        def sweep(stage):
            run_threads(group_sweep, [
                (self.entropy, self.mask, order, group_start, np.arange(lo, hi), self.incorrect, self.base_dev,
                 self.base, self.first_base, self.shift, self.knobs, coef_batch, by_group, stage, self.n_valid,
                 self.last, self.entropy_sum, errors[t], self.row_moments, per_group, self.intercept, self.slope,
                 self.run_fwd, self.run_bwd, self.conflict_lam, out, self.row_stats)
                for t, (lo, hi) in enumerate(shares)])  # fmt: skip

        if by_group and self.params.conflict_mask:
            mask_rows(self.mask, np.arange(b), self.n_valid, self.last)  # the conflict runs need each row's last column
            self.conflict_runs(responses)
        if self.params.norm_scope == "batch":
            sweep(0)  # per-group weights, batch statistics: every row's moments before any row is written
            self.check(sum(errors))
            set_sums = np.zeros((2, 4))
            add_rows(np.arange(b), self.incorrect, self.n_valid, self.row_moments, self.base, self.first_base,
                     self.alpha1, self.alpha2, set_sums)  # fmt: skip
            self.set_scales(set_sums)
            sweep(2)
        else:
            sweep(1)
            self.check(sum(errors))
        d, d2, n, neg = self.row_moments[:, 0], self.row_moments[:, 1], self.n_valid, self.incorrect
        rows_x = n * self.shift[neg.astype(np.int64)] + self.alpha1 * self.base_dev * n + self.sign * self.alpha2 * d
        shaped = np.array([rows_x[~neg].sum(), rows_x[neg].sum()])
        w, w2 = d + n, d2 + 2 * d + n  # per row: sum w and sum w^2 from sum (w - 1) and sum (w - 1)^2
        weights = (
            np.array([w[~neg].sum(), w[neg].sum()]),
            np.array([w2[~neg].sum(), w2[neg].sum()]),
            per_group[:, 1:].max(0) if num_groups else np.zeros(2),
            float(per_group[:, 0].max()) if num_groups else 0.0,
        )
        return shaped, weights


def _diagnostics(params, correct, group_of_row, num_groups, n_valid, entropy_sum, row_stats, shaped, w_sum, w_sq, w_max,
                 conservation) -> dict:  # fmt: skip
    """The ``gtpo/...`` diagnostics from per-row and per-polarity sums."""

    def ratio(num, den):
        return float(num) / float(den) if den > 0 else 0.0

    a2 = float(params.alpha2)
    out: dict[str, float] = {}
    tokens = [n_valid[correct].sum(), n_valid[~correct].sum()]
    for q, name in enumerate(("pos", "neg")):
        mean = ratio(w_sum[q], tokens[q]) if a2 > 0 else 0.0
        sq = ratio(w_sq[q], tokens[q]) if a2 > 0 else 0.0
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(max(sq - mean * mean, 0.0))
        out[f"weight_{name}_max"] = float(w_max[q]) if a2 > 0 else 0.0
    total, size, pos, negs = row_stats[:, 0], row_stats[:, 1], row_stats[:, 2], row_stats[:, 3]
    n_all = n_valid.sum()
    nonempty = n_valid > 0
    rows_per_group = np.bincount(group_of_row[nonempty], minlength=num_groups)
    correct_per_group = np.bincount(group_of_row[nonempty & correct], minlength=num_groups)
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
            "conservation_err": float(conservation),
            "frac_groups_all_correct": ratio((live & (correct_per_group == rows_per_group)).sum(), live.sum()),
            "frac_groups_all_wrong": ratio((live & (correct_per_group == 0)).sum(), live.sum()),
            "entropy_correct_mean": ratio(entropy_sum[correct].sum(), tokens[0]),
            "entropy_incorrect_mean": ratio(entropy_sum[~correct].sum(), tokens[1]),
        }
    )
    return out
