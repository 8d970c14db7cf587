"""Float64 loop-free reference of the GTPO estimator: the oracle the chunked production path is tested against.

Every step materialises its ``[B, L]`` float64 tensor (shaped rewards from
:func:`gtpo.algorithms.entropy_weights.gtpo_shaped_rewards`, one whitening per set), so it reads as the equations
(arXiv 2508.04349, Eq. 3, 5, 6; docs/ALGORITHMS.md §3.3) at the cost of ~100 passes over ``[B, L]``.
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.entropy_shaping import GTPOParams, shaping_bases, validate_with_params
from gtpo.algorithms.entropy_weights import gtpo_shaped_rewards, weight_segments
from gtpo.algorithms.group_ops import masked_group_mean_std, segment_sum
from gtpo.algorithms.gtpo_token import _conflict_lambda, check_responses
from gtpo.algorithms.shaping_diagnostics import gtpo_diagnostics_from_rows


@torch.no_grad()
def whiten_sets(
    x: torch.Tensor,
    select: torch.Tensor,
    gid: torch.Tensor | None,
    num_groups: int,
    *,
    unbiased: bool,
    eps: float,
    zero_var_rtol: float,
) -> torch.Tensor:
    """Whiten ``x`` over the selected tokens of each group (or of the batch when ``gid`` is None).

    ``(x - mean) / (std + eps)`` on selected tokens; 0 elsewhere. A set with fewer than two tokens or with
    ``std <= zero_var_rtol * mean|x|`` is constant and gets 0 (docs/ALGORITHMS.md §3.3, §3.6).

    Args:
        x: ``[B, L]`` values. select: ``[B, L]`` bool. gid: ``[B]`` int64 or None. num_groups: ``NG``.

    Returns:
        ``[B, L]`` float64.
    """
    b = x.shape[0]
    if gid is None:
        gid = torch.zeros(b, dtype=torch.long, device=x.device)
        num_groups = 1
    sel = select.bool()
    xd = x.to(torch.float64)
    mean, std, count = masked_group_mean_std(xd, sel, gid, num_groups, unbiased=unbiased)
    abs_mean = segment_sum(torch.where(sel, xd.abs(), 0.0).sum(-1), gid, num_groups) / count.clamp(min=1)
    constant = (count <= 1) | (std <= zero_var_rtol * abs_mean)
    out = (xd - mean[gid][:, None]) / (std[gid][:, None] + eps)
    return torch.where(sel & ~constant[gid][:, None], out, 0.0)


@torch.no_grad()
def gtpo_reference(entropy, response_mask, rewards, gid, num_groups, params=None, reward_offset=None, responses=None):
    """Direct float64 evaluation of ``gtpo_token_advantages`` (same arguments; results equal up to float32)."""
    params = params or GTPOParams()
    validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset)
    device = entropy.device
    m = response_mask.to(device).bool()
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.to(device)
    if reward_offset is not None:
        reward_offset = reward_offset.to(device)
    correct = rewards.detach() > params.reward_threshold
    shaped = gtpo_shaped_rewards(entropy, m, rewards, gid, num_groups, params, reward_offset)
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset).to(device)
    seg, n_seg = weight_segments(correct, gid, num_groups, params.weight_scope)
    counts = segment_sum(m.to(torch.float64), seg, n_seg)

    scope_gid = gid if params.norm_scope == "group" else None
    kw = dict(unbiased=params.std == "unbiased", eps=float(params.eps), zero_var_rtol=float(params.zero_var_rtol))
    valid_pos, valid_neg = m & correct[:, None], m & ~correct[:, None]
    if params.norm_mode == "split":
        # Eq. 6 read as: correct and incorrect tokens are separate sets
        adv = whiten_sets(shaped, valid_pos, scope_gid, num_groups, **kw)
        adv = adv + whiten_sets(shaped, valid_neg, scope_gid, num_groups, **kw)
    elif params.norm_mode == "zero_fill":
        # Eq. 3 / 5: r~+ is 0 on incorrect tokens, r~- on correct ones; each field over all valid tokens
        field_pos = torch.where(valid_pos, shaped, 0.0)
        field_neg = torch.where(valid_neg, shaped, 0.0)
        adv_pos = whiten_sets(field_pos, m, scope_gid, num_groups, **kw)
        adv_neg = whiten_sets(field_neg, m, scope_gid, num_groups, **kw)
        adv = torch.where(correct[:, None], adv_pos, adv_neg)
    else:
        adv = whiten_sets(shaped, m, scope_gid, num_groups, **kw)

    diag: dict[str, float] = {}
    if params.conflict_mask:
        check_responses(responses, m)
        lam, diag["conflict_token_frac"] = _conflict_lambda(responses, m, correct, gid, num_groups, params)
        adv = adv * lam.to(device=device, dtype=torch.float64)

    adv = torch.where(m, adv, 0.0)
    diag.update(_diagnostics(entropy, m, correct, gid, num_groups, params, shaped, adv, base, seg, counts))
    return adv.to(torch.float32), diag


def _diagnostics(entropy, m, correct, gid, num_groups, params, shaped, adv, base, seg, counts):
    """Small set of python floats describing one GTPO batch (row-level reductions, few passes over ``[B, L]``).

    Keys: ``weight_pos_mean/std/max`` and ``weight_neg_*`` (the count-scaled entropy weights ``share*d_t``, mean 1
    by construction; 0 when ``alpha2 = 0``), ``shaped_correct_mean`` / ``shaped_incorrect_mean``,
    ``adv_correct_mean`` / ``adv_incorrect_mean`` (token means per polarity), ``adv_pos_mean`` / ``adv_neg_mean``
    (mean of the positive / negative advantages), ``adv_abs_mean``, ``frac_tokens_adv_pos`` / ``frac_tokens_adv_neg``,
    ``conservation_err`` (max over groups and positions of ``|sum r~ - (a1*sum base +- a2*count)|``, both
    polarities; ~``a2*eps/H`` unless all entropies at a position are 0), ``frac_groups_all_correct`` /
    ``frac_groups_all_wrong``, ``entropy_correct_mean`` / ``entropy_incorrect_mean`` (token means).
    """
    a1, a2 = float(params.alpha1), float(params.alpha2)
    m64 = m.to(torch.float64)
    lens = m64.sum(-1)
    # the entropy term of each token, signed so that it is >= 0 on both polarities: a2 * share * count
    sign = torch.where(correct, 1.0, -1.0).to(torch.float64)
    term = (shaped - (a1 * base)[:, None] * m64) * sign[:, None]
    err = (segment_sum(term, seg, counts.shape[0]) - a2 * counts).abs()
    w = term / a2 if a2 > 0 else torch.zeros_like(term)
    w_row, w2_row = w.sum(-1), (w * w).sum(-1)
    w_max = torch.where(m, w, -math.inf).amax(-1) if w.shape[-1] else torch.zeros_like(lens)
    ent_row = torch.where(m, entropy.detach(), 0.0).sum(-1).to(torch.float64)
    adv_row, abs_row = adv.sum(-1), adv.abs().sum(-1)
    pos_row, neg_row = adv.clamp(min=0).sum(-1), adv.clamp(max=0).sum(-1)
    npos_row, nneg_row = (adv > 0).sum(-1).to(torch.float64), (adv < 0).sum(-1).to(torch.float64)
    return gtpo_diagnostics_from_rows(
        correct,
        gid,
        num_groups,
        lens,
        w_row=w_row,
        w2_row=w2_row,
        w_max=w_max,
        shaped_row=shaped.sum(-1),
        adv_row=adv_row,
        abs_row=abs_row,
        pos_row=pos_row,
        neg_row=neg_row,
        npos_row=npos_row,
        nneg_row=nneg_row,
        ent_row=ent_row,
        conservation_err=float(err.max()) if err.numel() else 0.0,
    )
