"""GTPO-trajectory's compiled CPU kernel (numba): conflict runs, entropy filter and penalty, token advantages.

Paper: Simoni et al., arXiv 2508.03772 (TACL 2026); official code ``winstonsmith1897/GTPO``. The definition is
:func:`gtpo.algorithms.trajectory.gtpo_traj_reference` (torch); this kernel computes the same outputs, tested against
it, with one read of the entropy and the mask (``<H>_i``, each row's valid count and last column), a scan of the
token ids that stops where the conflict runs stop, and one write of the advantages.

- Conflict runs: :func:`gtpo.algorithms.conflict_runs_kernel.conflict_runs` (docs/ALGORITHMS.md §6.2), the first
  ``f_i`` and the last ``b_i`` valid columns of each row, so ``lambda`` is never materialised:
  ``lambda_{i,t} = lam_c^[t < f_i] * lam_c^[t > last_i - b_i]`` on valid tokens.
- ``<H>_i``, ``delta_i``, ``A'_i = delta_i (A_i - gamma <H>_i)`` (group skipping, the ``code_sum`` scale,
  ``1/n_conf``) are per-row arithmetic on ``[B]``; the advantages ``A'_i lambda_{i,t} / n_conf_i`` are written in one
  pass (:func:`_write`).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from gtpo.algorithms.conflict_runs_kernel import conflict_runs
from gtpo.algorithms.kernel_support import (
    as_numpy_mask,
    compile_timer,
    jit_options,
    kernel_output,
    num_threads,
    run_blocks,
)
from gtpo.algorithms.trajectory_params import GTPOTrajOutput, check_entropy_values

__all__ = ["gtpo_traj_kernel"]


@njit(**jit_options())
def _row_sums(entropy, mask, lo, hi, n_valid, last, entropy_sum):
    """Rows ``lo:hi``: valid count, last valid column and raw entropy sum over the valid tokens (padding unread)."""
    length = entropy.shape[1]
    for i in range(lo, hi):  # the mask first, apart: one stream at a time runs faster than two interleaved
        m_row = mask[i]
        count = 0
        lst = -1
        for t in range(length):
            valid = m_row[t] != 0
            count += valid
            lst = max(lst, t if valid else -1)
        n_valid[i] = count
        last[i] = lst
    for i in range(lo, hi):
        h_row = entropy[i]
        count = n_valid[i]
        lst = last[i]
        total = 0.0
        if count == lst + 1:
            for t in range(count):
                total += h_row[t]
        else:
            m_row = mask[i]
            for t in range(lst + 1):
                total += h_row[t] if m_row[t] != 0 else 0.0
        entropy_sum[i] = total


@njit(**jit_options())
def _write(mask, lo, hi, n_valid, last, scale, lam_c, run_fwd, run_bwd, out):
    """``adv_{i,t} = scale_i * lambda_{i,t}`` on the valid tokens of rows ``lo:hi``, 0 on every other position."""
    one = np.float32(1.0)
    length = out.shape[1]
    for i in range(lo, hi):
        lst = last[i]
        a = scale[i]
        lc = lam_c[i]
        o = out[i]
        if n_valid[i] == lst + 1:
            for t in range(lst + 1):
                o[t] = a
        else:
            m_row = mask[i]
            for t in range(lst + 1):
                o[t] = a if m_row[t] != 0 else 0.0
        for t in range(min(run_fwd[i], lst + 1)):
            o[t] = (lc * (lc if t > lst - run_bwd[i] else one)) * a
        for t in range(max(lst + 1 - run_bwd[i], run_fwd[i]), lst + 1):
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
    # float32 / float64 entropy is read as it is, other float types as float32
    values = (entropy if entropy.dtype in (torch.float32, torch.float64) else entropy.float()).detach()
    values = values.contiguous().numpy()
    mask = as_numpy_mask(response_mask)
    b, length = values.shape
    group_of_row = gid.to(torch.long).numpy()
    pol = polarity.numpy()
    n = np.zeros(b, np.int64)
    last = np.full(b, -1, np.int64)
    hsum = np.zeros(b)
    threads = num_threads(b)
    run_blocks(_row_sums, b, threads, lambda lo, hi, w: (values, mask, lo, hi, n, last, hsum))
    if not np.isfinite(hsum).all():
        check_entropy_values(entropy, response_mask)
    valid_rows = n > 0
    h_bar = (hsum / np.maximum(n, 1)).astype(np.float32)
    if params.use_ini_gate and h_ini is None:
        h_ini = float(h_bar[valid_rows].mean()) if valid_rows.any() else 0.0
    gate_open = params.use_ini_gate and h_ini > params.tau
    delta = np.ones(b, np.float32) if gate_open else (h_bar <= params.tau).astype(np.float32)

    f_len, b_len = conflict_runs(responses, mask, group_of_row, num_groups, pol, last)
    overlap = np.maximum(f_len + b_len - (last + 1), 0)
    n_conflict = f_len + b_len - overlap
    counted = np.maximum(f_len, b_len) if params.nconf_count == "official" else n_conflict
    n_conf = np.where(pol != 0, np.maximum(counted, 1), 1)

    a = adv.numpy()
    shaped = delta * (a - np.float32(params.gamma) * h_bar)
    if params.skip_zero_adv_groups:
        shaped = np.where(zero_var.numpy(), np.float32(0.0), shaped)
    if params.agg == "code_sum":
        shaped = shaped * np.bincount(group_of_row, minlength=num_groups).astype(np.float32)[group_of_row]
    scale = shaped / n_conf.astype(np.float32) if params.divide_by_nconf else shaped
    lam_c = np.where(pol > 0, params.lam_pos, params.lam_neg).astype(np.float32)
    lam_c = np.where(pol == 0, np.float32(1.0), lam_c)

    out = kernel_output(b, length)
    o = out.numpy()
    run_blocks(_write, b, threads, lambda lo, hi, w: (mask, lo, hi, n, last, scale, lam_c, f_len, b_len, o), n)

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
