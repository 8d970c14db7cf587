"""GTPO-trajectory's compiled CPU kernel (numba): conflict runs, entropy filter and penalty, token advantages.

Paper: Simoni et al., arXiv 2508.03772 (TACL 2026); official code ``winstonsmith1897/GTPO``. The definition is
:func:`gtpo.algorithms.trajectory.gtpo_traj_reference` (torch); this kernel computes the same outputs, tested against
it, with one read of the entropy and the mask (``<H>_i``, each row's valid count and last column), a scan of the
token ids that stops where the conflict runs stop, and one write of the advantages.

- Conflict runs (:func:`conflict_runs`, docs/ALGORITHMS.md §6.2): per group with both polarities, position by
  position from the start (forward) and from each row's last valid token (backward, right-aligned), a row's run goes
  on while its token is shared by at least one positive and one negative active completion at that aligned position
  (the row itself counts) and stops at the first position where it is not, or where the row's mask is 0. The runs are
  the first ``f_i`` and the last ``b_i`` valid columns of the row, so ``lambda`` is never materialised:
  ``lambda_{i,t} = lam_c^[t < f_i] * lam_c^[t > last_i - b_i]`` on valid tokens.
- ``<H>_i``, ``delta_i``, ``A'_i = delta_i (A_i - gamma <H>_i)`` (group skipping, the ``code_sum`` scale,
  ``1/n_conf``) are per-row arithmetic on ``[B]``; the advantages ``A'_i lambda_{i,t} / n_conf_i`` are written in one
  pass (:func:`_write`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from numba.core.errors import NumbaError

from gtpo.algorithms.kernel_support import (
    JIT_OPTIONS,
    as_numpy_mask,
    compile_timer,
    kernel_output,
    num_threads,
    run_blocks,
    run_threads,
)

__all__ = ["conflict_runs", "gtpo_traj_kernel", "CompileError"]

CompileError = NumbaError


@njit(**JIT_OPTIONS)
def _runs(ids, M, order, gptr, pol, last, backward, run):
    """Leading (``backward=False``) or trailing run length of raw-conflict tokens of every row, group by group."""
    length = M.shape[1]
    for j in range(gptr.shape[0] - 1):
        rows = order[gptr[j] : gptr[j + 1]]
        has_pos = False
        has_neg = False
        for i in rows:
            has_pos |= pol[i] > 0
            has_neg |= pol[i] < 0
        if not (has_pos and has_neg):
            continue
        size = rows.shape[0]
        alive = np.zeros(size, np.bool_)
        ok = np.zeros(size, np.bool_)
        tok = np.zeros(size, ids.dtype)
        any_alive = False
        for a in range(size):
            alive[a] = pol[rows[a]] != 0
            any_alive |= alive[a]
        d = 0
        while any_alive:
            # every active row's token at aligned position d (valid only where its mask is 1)
            for a in range(size):
                i = rows[a]
                col = last[i] - d if backward else d
                ok[a] = pol[i] != 0 and 0 <= col < length and M[i, col] != 0
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
                            if pol[rows[other]] > 0:
                                shared_pos = True
                            else:
                                shared_neg = True
                if shared_pos and shared_neg:
                    run[rows[a]] += 1
                    any_alive = True
                else:
                    alive[a] = False
            d += 1


def conflict_runs(responses: torch.Tensor, mask: np.ndarray, gid: np.ndarray, num_groups: int,
                  polarity: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Forward and backward conflict-run lengths ``(f [B], b [B])`` int64 (docs/ALGORITHMS.md §6.2).

    Args:
        responses: ``[B, L]`` integer token ids (CPU). mask: ``[B, L]`` numpy mask. gid: ``[B]`` int64 group ids;
        num_groups: ``NG``. polarity: ``[B]`` +1 / -1 / 0 (inactive). last: ``[B]`` last valid column (-1: empty).
    """
    ids = responses.detach().contiguous().numpy()
    order = np.argsort(gid, kind="stable")
    gptr = np.concatenate([[0], np.cumsum(np.bincount(gid, minlength=num_groups))]).astype(np.int64)
    pol = np.ascontiguousarray(polarity, dtype=np.int8)
    f = np.zeros(gid.shape[0], np.int64)
    b = np.zeros(gid.shape[0], np.int64)
    run_threads(_runs, [(ids, mask, order, gptr, pol, last, False, f), (ids, mask, order, gptr, pol, last, True, b)])
    return f, b


@njit(**JIT_OPTIONS)
def _row_sums(H, M, lo, hi, n, last, hsum):
    """Rows ``lo:hi``: valid count, last valid column and raw entropy sum over the valid tokens (padding unread)."""
    length = H.shape[1]
    for i in range(lo, hi):  # the mask first, apart: one stream at a time runs faster than two interleaved
        m_row = M[i]
        count = 0
        lst = -1
        for t in range(length):
            valid = m_row[t] != 0
            count += valid
            lst = max(lst, t if valid else -1)
        n[i] = count
        last[i] = lst
    for i in range(lo, hi):
        h_row = H[i]
        count = n[i]
        lst = last[i]
        total = 0.0
        if count == lst + 1:
            for t in range(count):
                total += h_row[t]
        else:
            m_row = M[i]
            for t in range(lst + 1):
                total += h_row[t] if m_row[t] != 0 else 0.0
        hsum[i] = total


@njit(**JIT_OPTIONS)
def _write(M, lo, hi, n, last, scale, lam_c, fwd, bwd, out):
    """``adv_{i,t} = scale_i * lambda_{i,t}`` on the valid tokens of rows ``lo:hi``, 0 on every other position."""
    one = np.float32(1.0)
    length = out.shape[1]
    for i in range(lo, hi):
        lst = last[i]
        a = scale[i]
        lc = lam_c[i]
        o = out[i]
        if n[i] == lst + 1:
            for t in range(lst + 1):
                o[t] = a
        else:
            m_row = M[i]
            for t in range(lst + 1):
                o[t] = a if m_row[t] != 0 else 0.0
        for t in range(min(fwd[i], lst + 1)):
            o[t] = (lc * (lc if t > lst - bwd[i] else one)) * a
        for t in range(max(lst + 1 - bwd[i], fwd[i]), lst + 1):
            o[t] = lc * a
        for t in range(lst + 1, length):
            o[t] = 0.0


def gtpo_traj_kernel(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini):
    """GTPO-trajectory on CPU tensors after the group advantages (validated by the caller).

    Args:
        response_mask, responses, entropy: ``[B, L]``. gid: ``[B]`` int64; num_groups: ``NG``. params: resolved
        ``GTPOTrajParams``. adv, polarity, zero_var: ``centred_advantages`` of the scores. h_ini: ``<H>_ini`` or None
        (measured on this batch when the gate needs it).

    Returns:
        :class:`gtpo.algorithms.trajectory.GTPOTrajOutput`, as :func:`gtpo.algorithms.trajectory.gtpo_traj_reference`.
    """
    with compile_timer() as timer:
        out = _gtpo_traj(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini)
    if timer.seconds > 0:
        out.metrics["gtpo_traj/kernel_compile_s"] = timer.seconds
    return out


def _gtpo_traj(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini):
    from gtpo.algorithms.trajectory import GTPOTrajOutput, check_entropy_values

    # float32 / float64 entropy is read as it is, other float types as float32
    H = (entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()).detach()
    H = H.contiguous().numpy()
    M = as_numpy_mask(response_mask)
    b, length = H.shape
    gid = gid.to(torch.long).numpy()
    pol = polarity.numpy()
    n = np.zeros(b, np.int64)
    last = np.full(b, -1, np.int64)
    hsum = np.zeros(b)
    threads = num_threads(b)
    run_blocks(_row_sums, b, threads, lambda lo, hi, w: (H, M, lo, hi, n, last, hsum))
    if not np.isfinite(hsum).all():
        check_entropy_values(entropy, response_mask)
    valid_rows = n > 0
    h_bar = (hsum / np.maximum(n, 1)).astype(np.float32)
    if params.use_ini_gate and h_ini is None:
        h_ini = float(h_bar[valid_rows].mean()) if valid_rows.any() else 0.0
    gate_open = params.use_ini_gate and h_ini > params.tau
    delta = np.ones(b, np.float32) if gate_open else (h_bar <= params.tau).astype(np.float32)

    f_len, b_len = conflict_runs(responses, M, gid, num_groups, pol, last)
    overlap = np.maximum(f_len + b_len - (last + 1), 0)
    n_conflict = f_len + b_len - overlap
    counted = np.maximum(f_len, b_len) if params.nconf_count == "official" else n_conflict
    n_conf = np.where(pol != 0, np.maximum(counted, 1), 1)

    a = adv.numpy()
    shaped = delta * (a - np.float32(params.gamma) * h_bar)
    if params.skip_zero_adv_groups:
        shaped = np.where(zero_var.numpy(), np.float32(0.0), shaped)
    if params.agg == "code_sum":
        shaped = shaped * np.bincount(gid, minlength=num_groups).astype(np.float32)[gid]
    scale = shaped / n_conf.astype(np.float32) if params.divide_by_nconf else shaped
    lam_c = np.where(pol > 0, params.lam_pos, params.lam_neg).astype(np.float32)
    lam_c = np.where(pol == 0, np.float32(1.0), lam_c)

    out = kernel_output(b, length)
    o = out.numpy()
    run_blocks(_write, b, threads, lambda lo, hi, w: (M, lo, hi, n, last, scale, lam_c, f_len, b_len, o), n)

    n_rows = max(int(valid_rows.sum()), 1)
    n_tok = max(float(n.sum()), 1.0)
    lam64 = lam_c.astype(np.float64)
    lam_row = n - n_conflict + lam64 * (n_conflict - overlap) + lam64 * lam64 * overlap
    metrics = {
        "gtpo_traj/conflict_token_frac": float(n_conflict.sum()) / n_tok,
        "gtpo_traj/pos_conflict_token_frac": float(n_conflict[pol > 0].sum()) / n_tok,
        "gtpo_traj/neg_conflict_token_frac": float(n_conflict[pol < 0].sum()) / n_tok,
        "gtpo_traj/conflict_traj_frac": float(((n_conflict > 0) & valid_rows).sum()) / n_rows,
        "gtpo_traj/filtered_traj_frac": float(((delta == 0) & valid_rows).sum()) / n_rows,
        "gtpo_traj/active_traj_frac": float(((pol != 0) & valid_rows).sum()) / n_rows,
        "gtpo_traj/zero_var_traj_frac": float((zero_var.numpy() & valid_rows).sum()) / n_rows,
        "gtpo_traj/mean_entropy": float(h_bar[valid_rows].mean()) if valid_rows.any() else 0.0,
        "gtpo_traj/shaped_adv_mean": float(shaped[valid_rows].mean()) if valid_rows.any() else 0.0,
        "gtpo_traj/adv_abs_mean": float((np.abs(scale).astype(np.float64) * lam_row).sum()) / n_tok,
        "gtpo_traj/filter_on": float(not gate_open),
    }
    if h_ini is not None:
        metrics["gtpo_traj/h_ini"] = float(h_ini)
    return GTPOTrajOutput(
        advantages=out,
        adv_seq=adv,
        shaped_seq=torch.from_numpy(shaped),
        mean_entropy=torch.from_numpy(h_bar),
        delta=torch.from_numpy(delta),
        polarity=polarity,
        n_conf=torch.from_numpy(n_conf),
        run_fwd=torch.from_numpy(f_len),
        run_bwd=torch.from_numpy(b_len),
        last=torch.from_numpy(last),
        lam_c=torch.from_numpy(lam_c),
        response_mask=response_mask,
        h_ini=h_ini,
        metrics=metrics,
    )
