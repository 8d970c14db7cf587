"""GTPO-token's whitening sets, Eq. 6 of Tan et al., arXiv 2508.04349, from the passes' sums (numba and numpy).

``A = (x - mean) / (std + eps)`` over each token's set, ``x`` the shaped reward of Eq. 3 / Eq. 5. The sets' counts,
means and centred second moments come in closed form from pass 1's per-position sums (batch scopes:
:func:`_closed_form`, the algebra in :mod:`gtpo.algorithms.gtpo_token_kernel`) or from the per-row moments (group
scopes: :func:`_group_scopes`, the rows visited group by group); :func:`_set_scales` combines the two polarities per
``norm_mode`` (``split``, ``joint``, ``zero_fill``: the other polarity's tokens as zeros, paper §2.2) and applies
the zero-variance rule (a set with fewer than two tokens or ``std <= zero_var_rtol * mean|x|`` is constant: advantage
0, the recipe's deviation documented in :mod:`gtpo.algorithms.shaping_params`). This module is the Python side;
the compiled set functions (``_set_scales``, ``_add_rows``, ``_row_scales``, ``_group_sweep``) sit in
:mod:`gtpo.algorithms.gtpo_token_passes` beside the loops they call, because numba's disk cache of a compiled
function is keyed on its own file only: a caller in another file would keep a stale copy of an edited callee.
"""

from __future__ import annotations

import numpy as np

from gtpo.algorithms.gtpo_token_passes import _add_rows, _group_sweep, _mask_rows, _moments
from gtpo.algorithms.kernel_support import row_shares, run_threads


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
