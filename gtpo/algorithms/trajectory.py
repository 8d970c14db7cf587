"""GTPO-trajectory (``gtpo_traj``): conflict-token weights, entropy filter and entropy penalty.

Paper: Simoni, Fontana, Rossolini, Saracino (, Mori), "GTPO: Trajectory-Based Policy Optimization in LLMs" /
"GTPO: Stabilizing Group Relative Policy Optimization via Gradient and Entropy Control", arXiv 2508.03772
(TACL 2026). Official code: ``winstonsmith1897/GTPO``. Specification: docs/ALGORITHMS.md §6.

Implemented (one completion ``i`` of a group, verl's right-padded ``[B, L]`` layout):

- Objective (README / paper, §6.1):
  ``J = E[ 1/G sum_i delta_i (A_i - gamma <H>_i) / |o_i| sum_t r_{i,t} lambda_{i,t} ]``.
- Conflict tokens (§6.2, the official ``build_conflict_mask`` semantics): among the *active* completions of a group
  (``P = {A_i > 0}``, ``N = {A_i < 0}``), token ``(i, t)`` is raw-conflicting when the pair (position, token id)
  occurs in at least one completion of ``P`` and one of ``N`` (``i`` itself counts). Only the leading contiguous
  run (forward, positions from the start) and the trailing contiguous run (backward, positions counted from the
  last valid token, i.e. right-aligned) are conflicts. ``lambda = lambda_fwd * lambda_bwd * m`` with ``lambda_pos``
  (2) on a positive completion's conflict tokens, ``lambda_neg`` (0) on a negative one's, 1 elsewhere; a token in
  both runs of a positive completion gets ``lambda_pos ** 2`` (4).
- Entropy filter ``delta_i = 1[<H>_i <= tau]``, optionally gated by the initial model's entropy (paper's 3-case
  ``delta``: filtering is on only when ``<H>_ini <= tau``), and the entropy penalty ``A'_i = delta_i (A_i - gamma
  <H>_i)`` (§6.3).
- The two behaviours of §6.5 through ``GTPOTrajParams.variant`` (``paper`` default, ``code``), which only sets
  defaults; every knob can be overridden.

This module holds the group advantage, the estimator :func:`gtpo_traj_advantages` (CPU tensors go to the compiled
kernel, :mod:`gtpo.algorithms.trajectory_kernel`) and its definition :func:`gtpo_traj_reference` (torch, for other
devices, for a missing or failing numba, and as the kernel's test oracle), whose conflict runs are
:mod:`gtpo.algorithms.conflict_tokens`. The knobs and the two variants' defaults are
:mod:`gtpo.algorithms.trajectory_params`.

Deliberate choices and deviations (all documented in the README's method section):

1. Conflict detection never builds the ``[groups, G, G, L]`` tensor of §6.6 (the kernel compares tokens position by
   position and stops where every run has stopped; the definition uses sort-based key membership) and runs end at
   ``response_mask`` zeros, never at a pad id. ``n_conf`` is the union of the
   two runs (``nconf_count="union"``, default under ``variant=paper``) or the official code's ``max(f, b)``
   (``"official"``, default under ``variant=code``); see that module and docs/ALGORITHMS.md §6.5.
2. ``<H>_ini`` (the ini gate) is the mean over the first batch's completions of ``<H>_i`` (same scale as the
   per-completion comparison); at ``<H>_ini == tau`` the filter is on. The gate compares ``<H>_ini`` with ``tau``
   (``ln 2`` under ``variant=paper``), a single threshold for both cases of the paper's ``delta``.
3. Polarity comes from the *unshaped* advantage sign (as in the official code). The centred advantage is computed
   in float64 and a group whose rewards are all equal gets exactly 0 (no rounding-noise polarity); a row whose
   centred reward is within ``1e-8`` of 0 is inactive.
4. ``agg="code_sum"`` (the official code's sum over the G completions of its one-prompt steps) is realised on top
   of verl's ``seq-mean-token-mean`` (a mean over all completions of the batch) by multiplying each completion's
   advantage by its group's size, which turns the batch mean into the mean over groups of per-group sums.
   ``agg="paper_mean"`` leaves the advantages unchanged (``1/G`` per group, then the mean over prompts).
5. None of the official code's defects (docs/ALGORITHMS.md §6.5 list) is reproduced: no reference/base model pass, no
   debug prints, no pad-id heuristic, ordinary autograd through verl's loss (the ratio is verl's, ``exp(0) = 1``
   on-policy with ``ppo_epochs=1``).
6. ``skip_zero_adv_groups`` zeroes the whole shaped advantage of a group whose rewards are all equal (the paper's
   "no update"); with it off (``variant=code``) such a group keeps ``-gamma <H>_i`` (the code's push-down).
7. A NaN or inf entropy on a valid token raises (padding may hold anything); the official code would propagate it.
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.conflict_tokens import (
    check_conflict_inputs,
    conflict_parts,
    conflict_weights,
    run_conflict_counts,
)
from gtpo.algorithms.group_ops import group_mean_std, per_row, segment_sum
from gtpo.algorithms.kernel_dispatch import kernel_guard, kernel_on
from gtpo.algorithms.trajectory_params import ADV_NORMS, GTPOTrajOutput, GTPOTrajParams, check_entropy_values

# conflict_weights stays importable from here for the GTPO-token conflict-mask option.
__all__ = [
    "GTPOTrajOutput",
    "centred_advantages",
    "conflict_weights",
    "entropy_filter",
    "gtpo_traj_advantages",
    "gtpo_traj_reference",
]

# ---------------------------------------------------------------------------------------------------------------
# Group advantage and the estimator (§6.3, §6.5, §6.6)
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def centred_advantages(
    scores: torch.Tensor, gid: torch.Tensor, num_groups: int, adv_norm: str, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-relative advantage ``A_i`` and the polarity of each completion.

    Args:
        scores: ``[B]`` sequence rewards.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``.
        adv_norm: ``"none"``: ``A = r - mean_g(r)`` (official code); ``"std"``: ``(r - mean_g(r)) / (std_g(r) + eps)``
            with the unbiased std (verl's GRPO convention; a group of one row has std 0).
        eps: std epsilon.

    Returns:
        ``(A [B] float32, polarity [B] int8, zero_var [B] bool)``: ``zero_var`` marks rows of groups whose rewards are
        all equal; those rows have ``A = 0`` exactly and polarity 0.
    """
    if adv_norm not in ADV_NORMS:
        raise ValueError(f"adv_norm={adv_norm!r}: must be one of {list(ADV_NORMS)}")
    r = scores.to(torch.float64)
    mean, std, _ = group_mean_std(r, gid, num_groups, unbiased=True)
    gmax = torch.full((num_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amax")
    gmin = torch.full((num_groups,), math.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amin")
    zero_var = per_row(gmax == gmin, gid)
    centred = torch.where(zero_var, torch.zeros_like(r), r - per_row(mean, gid))
    centred = torch.where(centred.abs() <= 1e-8, torch.zeros_like(r), centred)
    polarity = torch.sign(centred).to(torch.int8)
    adv = centred / (per_row(std, gid) + eps) if adv_norm == "std" else centred
    return adv.to(torch.float32), polarity, zero_var


@torch.no_grad()
def entropy_filter(mean_entropy: torch.Tensor, tau: float, use_ini_gate: bool, h_ini: float | None) -> torch.Tensor:
    """``delta_i`` (§6.1 / §6.3): 1 keeps completion ``i``, 0 drops it.

    Args:
        mean_entropy: ``[B]`` ``<H>_i``.
        tau: threshold (kept when ``<H>_i <= tau``; ``inf`` disables the filter).
        use_ini_gate: the paper's 3-case ``delta``: filter only when ``<H>_ini <= tau``, else keep every completion.
        h_ini: ``<H>_ini`` (required when ``use_ini_gate``). At ``<H>_ini == tau`` the filter is on.

    Returns:
        ``[B]`` float32 in {0, 1}.
    """
    if use_ini_gate:
        if h_ini is None:
            raise ValueError("h_ini=None: the ini gate needs the initial model's mean entropy")
        if h_ini > tau:
            return torch.ones_like(mean_entropy, dtype=torch.float32)
    return (mean_entropy <= tau).to(torch.float32)


@torch.no_grad()
def gtpo_traj_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    responses: torch.Tensor,
    entropy: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GTPOTrajParams,
    h_ini: float | None = None,
    *,
    measure_h_ini: bool = False,
) -> GTPOTrajOutput:
    """Token-level GTPO-trajectory advantages (docs/ALGORITHMS.md §6.6), to be aggregated with ``seq-mean-token-mean``.

    ``adv[i, t] = c_g * delta_i * (A_i - gamma <H>_i) * lambda_{i,t} / n_conf_i^{[divide_by_nconf]}``, where
    ``c_g`` is the group size under ``agg="code_sum"`` and 1 under ``"paper_mean"``; groups whose rewards are all
    equal get 0 when ``skip_zero_adv_groups``. CPU tensors go to the compiled kernel
    (:mod:`gtpo.algorithms.trajectory_kernel`), others to :func:`gtpo_traj_reference`, the definition.

    Args:
        scores: ``[B]`` sequence rewards.
        response_mask: ``[B, L]`` 0/1.
        responses: ``[B, L]`` integer token ids.
        entropy: ``[B, L]`` per-token entropy (detached; old or current policy); NaN / inf on a valid token raise.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``.
        params: resolved :class:`GTPOTrajParams`.
        h_ini: ``<H>_ini`` used by the ini gate (overrides ``params.h_ini``; required when the gate is on, unless
            ``measure_h_ini``).
        measure_h_ini: with the gate on and no ``h_ini``, take ``<H>_ini`` as this batch's mean over completions of
            ``<H>_i`` (the first batch of a run); the value used is returned as ``h_ini``.

    Returns:
        :class:`GTPOTrajOutput`; ``metrics`` holds python floats keyed ``gtpo_traj/...`` (``gtpo_traj/
        kernel_compile_s`` on the call that compiled the kernel).
    """
    if entropy.shape != response_mask.shape:
        raise ValueError(f"entropy shape {tuple(entropy.shape)} != response_mask shape {tuple(response_mask.shape)}")
    if scores.shape != (response_mask.shape[0],):
        raise ValueError(f"scores must be [B]={response_mask.shape[0]}, got {tuple(scores.shape)}")
    if h_ini is None:
        h_ini = params.h_ini
    if params.use_ini_gate and h_ini is None and not measure_h_ini:
        raise ValueError("h_ini=None: the ini gate needs the initial model's mean entropy")
    adv, polarity, zero_var = centred_advantages(scores, gid, num_groups, params.adv_norm, params.eps)
    check_conflict_inputs(responses, response_mask, gid, num_groups, polarity)
    on_cpu = all(t.device.type == "cpu" for t in (response_mask, responses, entropy))
    if on_cpu and kernel_on("trajectory_kernel"):
        with kernel_guard("trajectory_kernel"):  # numba missing or failing: the definition below
            from gtpo.algorithms import trajectory_kernel

            return trajectory_kernel.gtpo_traj_kernel(
                response_mask, responses, entropy, gid.cpu(), num_groups, params, adv, polarity, zero_var, h_ini
            )
    check_entropy_values(entropy, response_mask)
    return gtpo_traj_reference(
        response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini
    )


@torch.no_grad()
def gtpo_traj_reference(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini):
    """The definition of :func:`gtpo_traj_advantages` in torch, after the group advantages (inputs validated).

    Args:
        response_mask, responses, entropy: ``[B, L]``. gid: ``[B]``; num_groups: ``NG``. params: resolved.
        adv, polarity, zero_var: :func:`centred_advantages` of the scores. h_ini: ``<H>_ini`` or None (measured
            here when the gate needs it).
    """
    device = response_mask.device
    lam_c = torch.where(polarity > 0, params.lam_pos, params.lam_neg).to(torch.float32)
    lam_c = torch.where(polarity == 0, torch.ones_like(lam_c), lam_c).to(device)
    _, _, f_len, b_len, last = conflict_parts(
        responses, response_mask, gid, num_groups, polarity, params.lam_pos, params.lam_neg, 32, 4096
    )
    n_conf, n_conflict, overlap = run_conflict_counts(f_len, b_len, last, polarity, params.nconf_count)
    valid = response_mask.to(device).bool()
    h_sum = torch.where(valid, entropy.detach().to(torch.float64), 0.0).sum(-1)
    n_valid = valid.sum(-1).to(torch.float64)
    h_bar = (h_sum / n_valid.clamp(min=1)).to(torch.float32)
    valid_rows = n_valid > 0
    if params.use_ini_gate and h_ini is None:
        h_ini = float(h_bar[valid_rows].mean()) if bool(valid_rows.any()) else 0.0
    delta = entropy_filter(h_bar, params.tau, params.use_ini_gate, h_ini)

    shaped = delta * (adv.to(device) - params.gamma * h_bar)
    if params.skip_zero_adv_groups:
        shaped = torch.where(zero_var.to(device), torch.zeros_like(shaped), shaped)
    if params.agg == "code_sum":
        group_size = segment_sum(torch.ones_like(shaped), gid.to(device), num_groups)
        shaped = shaped * group_size[gid.to(device)]
    row_scale = shaped / n_conf.to(torch.float32) if params.divide_by_nconf else shaped
    out = GTPOTrajOutput(
        advantages=torch.zeros(valid.shape, dtype=torch.float32, device=device),
        adv_seq=adv,
        shaped_seq=shaped,
        mean_entropy=h_bar,
        delta=delta,
        polarity=polarity,
        n_conf=n_conf,
        run_fwd=f_len,
        run_bwd=b_len,
        last=last,
        lam_c=lam_c,
        response_mask=response_mask,
        h_ini=h_ini,
        metrics={},
    )
    # lam is already 0 on padding: one product writes the token advantages
    out = out._replace(advantages=out.lam * row_scale[:, None])

    n_rows = max(int(valid_rows.sum()), 1)
    n_tok = max(float(n_valid.sum()), 1.0)
    active = polarity != 0
    # sum_t lam per row: lam_c on single-run tokens, lam_c**2 on tokens of both runs, 1 elsewhere
    lam_row = n_valid - n_conflict + lam_c.to(torch.float64) * (n_conflict - overlap) + lam_c.double() ** 2 * overlap
    ncf = n_conflict.to(torch.float64)
    metrics = {
        "gtpo_traj/conflict_token_frac": float(ncf.sum()) / n_tok,
        "gtpo_traj/pos_conflict_token_frac": float(ncf[polarity > 0].sum()) / n_tok,
        "gtpo_traj/neg_conflict_token_frac": float(ncf[polarity < 0].sum()) / n_tok,
        "gtpo_traj/conflict_traj_frac": float(((n_conflict > 0) & valid_rows).sum()) / n_rows,
        "gtpo_traj/filtered_traj_frac": float(((delta == 0) & valid_rows).sum()) / n_rows,
        "gtpo_traj/active_traj_frac": float((active & valid_rows).sum()) / n_rows,
        "gtpo_traj/zero_var_traj_frac": float((zero_var & valid_rows).sum()) / n_rows,
        "gtpo_traj/mean_entropy": float(h_bar[valid_rows].mean()) if bool(valid_rows.any()) else 0.0,
        "gtpo_traj/shaped_adv_mean": float(shaped[valid_rows].mean()) if bool(valid_rows.any()) else 0.0,
        "gtpo_traj/adv_abs_mean": float((row_scale.abs().to(torch.float64) * lam_row).sum()) / n_tok,
        "gtpo_traj/filter_on": float(not (params.use_ini_gate and h_ini is not None and h_ini > params.tau)),
    }
    if h_ini is not None:
        metrics["gtpo_traj/h_ini"] = float(h_ini)
    return out._replace(metrics=metrics)
