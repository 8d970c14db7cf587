"""GTPO-token's definition: Eq. 3, 5 and 6 of Tan et al., arXiv 2508.04349, as float64 torch (docs/ALGORITHMS.md §3).

This module states the estimator as the paper writes it, one ``[B, L]`` float64 tensor per step; it is the
documented definition, the oracle of the kernel's tests, and what :func:`gtpo.algorithms.entropy_shaping.
gtpo_token_advantages` evaluates where the compiled kernel (:mod:`gtpo.algorithms.gtpo_token_kernel`) cannot run
(tensors not on the CPU, numba missing or failing). The kernel computes the same quantities in two passes without
materialising them.

Eq. 3 (correct responses) and Eq. 5 (incorrect responses), with the eps guards of Remark 2.1::

    r+_{i,t} = a1 * base_i + a2 * H_{i,t} / (sum_{k in O+_t} H_{k,t} + eps) * d_t
    r-_{j,t} = a1 * base_j - a2 * (1/(H_{j,t}+eps)) / (sum_{k in O-_t} 1/(H_{k,t}+eps) + eps) * h_t

``d_t`` / ``h_t`` count the correct / incorrect responses active at position ``t`` (``response_mask[:, t] == 1``;
positions are absolute offsets from the response start). ``weight_scope`` says over which responses the sums and
counts run: ``"batch"`` (paper §4, "compares entropy across different problems") or ``"group"`` (as typeset).

Eq. 6: ``A = (x - mean) / (std + eps)`` over the whitening set of each token; the sets of ``norm_mode`` (``zero_fill``:
the r~+ field, 0 on incorrect tokens, and the r~- field, 0 on correct ones, each over all valid tokens of the scope;
``joint``: all signed shaped rewards of the scope; ``split``: each polarity's own tokens) and of ``norm_scope``
(``batch`` or ``group``). The knobs and every choice where the paper is silent (the deviations: eps guards,
zero-variance rule, std convention, negative base, clamped negative entropies) are in
:mod:`gtpo.algorithms.shaping_params`.
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.group_ops import masked_group_mean_std, segment_sum
from gtpo.algorithms.shaping_inputs import shaping_bases
from gtpo.algorithms.shaping_params import GTPOParams

__all__ = [
    "polarity_segments",
    "weight_segments",
    "active_counts",
    "entropy_shares",
    "gtpo_shaped_rewards",
    "whiten_sets",
    "gtpo_token_reference",
]

_F64 = torch.float64


def polarity_segments(correct: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Segment id per row: ``gid`` for correct rows, ``num_groups + gid`` for incorrect ones (``2 * NG`` segments)."""
    return gid.to(torch.long) + num_groups * (~correct.bool()).to(torch.long)


def weight_segments(
    correct: torch.Tensor, gid: torch.Tensor, num_groups: int, weight_scope: str
) -> tuple[torch.Tensor, int]:
    """``(segment id [B], n_segments)`` of the sums and counts of Eq. 3 / Eq. 5 under ``weight_scope``.

    ``"group"``: one segment per (polarity, group), :func:`polarity_segments`; ``"batch"``: one per polarity.
    """
    if weight_scope == "group":
        return polarity_segments(correct, gid, num_groups), 2 * num_groups
    return (~correct.bool()).to(torch.long), 2


@torch.no_grad()
def active_counts(
    response_mask: torch.Tensor, correct: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group, per-position survivor counts ``d_t`` (correct) and ``h_t`` (incorrect) (docs/ALGORITHMS.md §3.1).

    Args:
        response_mask: ``[B, L]`` 0/1; a response is active at ``t`` iff ``response_mask[b, t] == 1``.
        correct: ``[B]`` bool.
        gid: ``[B]`` int64 group ids; num_groups: ``NG`` (pass zeros and 1 for the batch-level counts).

    Returns:
        ``(d, h)``, each ``[NG, L]`` float64.
    """
    seg = polarity_segments(correct, gid, num_groups)
    counts = segment_sum(response_mask.bool().to(_F64), seg, 2 * num_groups)
    return counts[:num_groups], counts[num_groups:]


def _shares_and_counts(entropy, m, correct, gid, num_groups, eps, weight_scope):
    """Entropy share and active count of each token's polarity at its position (``[B, L]`` float64, 0 on padding)."""
    seg, n_seg = weight_segments(correct, gid, num_groups, weight_scope)
    m64 = m.to(_F64)
    h = torch.where(m, entropy.detach().to(_F64), 0.0).clamp_min_(0.0)
    # correct tokens weigh by H, incorrect ones by 1/(H + eps) (Eq. 3 / Eq. 5); padding by 0
    val = torch.where(correct[:, None], h, torch.reciprocal(h + eps)).mul_(m64)
    sums = segment_sum(val, seg, n_seg)
    counts = segment_sum(m64, seg, n_seg)
    share = val.div_(sums[seg].add_(eps))
    return share, counts[seg]


@torch.no_grad()
def entropy_shares(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    correct: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    eps: float = 1e-6,
    weight_scope: str = "batch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """ε-guarded entropy shares at each position (Eq. 3 and Eq. 5 without the count factor).

    ``share+ = H / (sum_{O+_t} H + eps)`` on correct tokens; ``share- = (1/(H+eps)) / (sum_{O-_t} 1/(H+eps) + eps)``
    on incorrect tokens, the sums over the weight scope. Multiplied by ``d_t`` / ``h_t`` they average to 1 over the
    active set (up to ε). If every active correct token at ``t`` has ``H = 0``, ``share+ = 0`` there
    (docs/ALGORITHMS.md §3.6); the negative side stays finite (``1/h_t`` each when all are equal).

    Args:
        entropy: ``[B, L]`` entropy (already validated; negatives clamp to 0). response_mask: ``[B, L]``.
        correct: ``[B]`` bool. gid: ``[B]``; num_groups: ``NG``. eps: the guard.
        weight_scope: ``"batch"`` or ``"group"``.

    Returns:
        ``(share_pos, share_neg)``, each ``[B, L]`` float64, zero outside their polarity and on padding.
    """
    c = correct.bool()
    m = response_mask.bool()
    share, _ = _shares_and_counts(entropy, m, c, gid.to(torch.long), num_groups, eps, weight_scope)
    return torch.where(c[:, None], share, 0.0), torch.where(c[:, None], 0.0, share)


@torch.no_grad()
def gtpo_shaped_rewards(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GTPOParams | None = None,
    reward_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """GTPO token-level shaped rewards ``r~`` (Eq. 3 for correct, Eq. 5 for incorrect responses).

    Under Eq. 3 / Eq. 5 a correct token's r~- and an incorrect token's r~+ are 0; this returns the non-zero one.

    Args:
        entropy: ``[B, L]`` old-policy token entropy (detached here). response_mask: ``[B, L]`` 0/1.
        rewards: ``[B]`` sequence rewards; correct iff ``> params.reward_threshold``.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. Rows in any order, groups of any size.
        params: :class:`GTPOParams` (None: the defaults); ``weight_scope`` picks the sums' scope.
        reward_offset: optional ``[B]`` additive reward (GROP penalty) added to both bases.

    Returns:
        ``[B, L]`` float64; ``a1*base_i + a2*share*d_t`` on correct tokens, ``a1*base_j - a2*share*h_t`` on
        incorrect tokens, 0 on padding.
    """
    params = params or GTPOParams()
    m = response_mask.bool()
    correct = rewards.detach() > params.reward_threshold
    share, cnt = _shares_and_counts(
        entropy, m, correct, gid.to(torch.long), num_groups, params.eps, params.weight_scope
    )
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset).to(share.device)
    a1, a2 = float(params.alpha1), float(params.alpha2)
    signed_a2 = (torch.where(correct, 1.0, -1.0).to(_F64) * a2)[:, None]
    return share.mul_(cnt).mul_(signed_a2).add_((a1 * base)[:, None]).mul_(m.to(_F64))


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
    """Eq. 6 over one kind of set: whiten ``x`` over the selected tokens of each group (or of the batch).

    ``(x - mean) / (std + eps)`` on selected tokens; 0 elsewhere. A set with fewer than two tokens or with
    ``std <= zero_var_rtol * mean|x|`` is constant and gets 0 (docs/ALGORITHMS.md §3.3, §3.6).

    Args:
        x: ``[B, L]`` values. select: ``[B, L]`` bool. gid: ``[B]`` int64, or None for one batch-wide set.
        num_groups: ``NG``.

    Returns:
        ``[B, L]`` float64.
    """
    b = x.shape[0]
    if gid is None:
        gid = torch.zeros(b, dtype=torch.long, device=x.device)
        num_groups = 1
    sel = select.bool()
    xd = x.to(_F64)
    mean, std, count = masked_group_mean_std(xd, sel, gid, num_groups, unbiased=unbiased)
    abs_mean = segment_sum(torch.where(sel, xd.abs(), 0.0).sum(-1), gid, num_groups) / count.clamp(min=1)
    constant = (count <= 1) | (std <= zero_var_rtol * abs_mean)
    out = (xd - mean[gid][:, None]) / (std[gid][:, None] + eps)
    return torch.where(sel & ~constant[gid][:, None], out, 0.0)


@torch.no_grad()
def gtpo_token_reference(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GTPOParams | None = None,
    reward_offset: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GTPO-token advantages (Eq. 3, 5, 6) and diagnostics, evaluated as written (inputs already validated).

    Args:
        entropy: ``[B, L]`` old-policy token entropy. response_mask: ``[B, L]`` 0/1. rewards: ``[B]``.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: :class:`GTPOParams` (None: the defaults).
        reward_offset: optional ``[B]`` additive reward (GROP), added to both bases.
        responses: ``[B, L]`` token ids (``params.conflict_mask``: the advantages are multiplied by GTPO-trajectory's
            conflict weights, arXiv 2508.03772 §6.2, with correctness as the polarity).

    Returns:
        ``(advantages [B, L] float32, zero on padding; diagnostics)``, the diagnostics described in
        :func:`gtpo.algorithms.entropy_shaping.gtpo_token_advantages`.
    """
    params = params or GTPOParams()
    device = entropy.device
    m = response_mask.to(device).bool()
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.to(device)
    if reward_offset is not None:
        reward_offset = reward_offset.to(device)
    correct = rewards.detach() > params.reward_threshold
    shaped = gtpo_shaped_rewards(entropy, m, rewards, gid, num_groups, params, reward_offset)

    scope_gid = gid if params.norm_scope == "group" else None
    kw = dict(unbiased=params.std == "unbiased", eps=float(params.eps), zero_var_rtol=float(params.zero_var_rtol))
    valid_pos, valid_neg = m & correct[:, None], m & ~correct[:, None]
    if params.norm_mode == "split":
        # Eq. 6 read as: correct and incorrect tokens are separate sets
        adv = whiten_sets(shaped, valid_pos, scope_gid, num_groups, **kw)
        adv = adv + whiten_sets(shaped, valid_neg, scope_gid, num_groups, **kw)
    elif params.norm_mode == "zero_fill":
        # Eq. 3 / 5: r~+ is 0 on incorrect tokens, r~- on correct ones; each field over all valid tokens
        adv_pos = whiten_sets(torch.where(valid_pos, shaped, 0.0), m, scope_gid, num_groups, **kw)
        adv_neg = whiten_sets(torch.where(valid_neg, shaped, 0.0), m, scope_gid, num_groups, **kw)
        adv = torch.where(correct[:, None], adv_pos, adv_neg)
    else:
        adv = whiten_sets(shaped, m, scope_gid, num_groups, **kw)

    diag: dict[str, float] = {}
    if params.conflict_mask:
        from gtpo.algorithms.conflict_tokens import conflict_weights

        polarity = torch.where(correct, 1, -1).to(torch.int8) * m.any(-1).to(torch.int8)
        lam, is_conflict = conflict_weights(
            responses.to(device), m, gid, num_groups, polarity, params.conflict_lam_pos, params.conflict_lam_neg
        )
        adv = adv * lam.to(_F64)
        diag["conflict_token_frac"] = float(is_conflict.sum()) / max(int(m.sum()), 1)
    adv = torch.where(m, adv, 0.0)
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset).to(device)
    diag.update(_diagnostics(entropy, m, correct, gid, num_groups, params, shaped, adv, base))
    return adv.to(torch.float32), diag


def _ratio(num, den) -> float:
    return float(num) / float(den) if float(den) > 0 else 0.0


def _diagnostics(entropy, m, correct, gid, num_groups, params, shaped, adv, base) -> dict[str, float]:
    """The ``gtpo/...`` diagnostics, each straight from its ``[B, L]`` float64 tensors."""
    a1, a2 = float(params.alpha1), float(params.alpha2)
    m64 = m.to(_F64)
    pos, neg = m & correct[:, None], m & ~correct[:, None]
    n_pos, n_neg, n_all = pos.sum(), neg.sum(), m.sum()
    # the entropy term of each token, signed so that it is >= 0 on both polarities: a2 * share * count
    sign = torch.where(correct, 1.0, -1.0).to(_F64)
    term = (shaped - (a1 * base)[:, None] * m64) * sign[:, None]
    seg, n_seg = weight_segments(correct, gid, num_groups, params.weight_scope)
    err = (segment_sum(term, seg, n_seg) - a2 * segment_sum(m64, seg, n_seg)).abs()
    w = term / a2 if a2 > 0 else torch.zeros_like(term)
    out: dict[str, float] = {}
    for name, sel, count in (("pos", pos, n_pos), ("neg", neg, n_neg)):
        mean = _ratio(w[sel].sum(), count)
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(max(_ratio((w[sel] ** 2).sum(), count) - mean * mean, 0.0))
        out[f"weight_{name}_max"] = float(w[sel].max()) if bool(sel.any()) else 0.0
    h = torch.where(m, entropy.detach().to(_F64), 0.0)
    nonempty = m.any(-1)
    rows_per_group = segment_sum(nonempty.to(_F64), gid, num_groups)
    correct_per_group = segment_sum((nonempty & correct).to(_F64), gid, num_groups)
    live = rows_per_group > 0
    out.update(
        {
            "shaped_correct_mean": _ratio(shaped[pos].sum(), n_pos),
            "shaped_incorrect_mean": _ratio(shaped[neg].sum(), n_neg),
            "adv_correct_mean": _ratio(adv[pos].sum(), n_pos),
            "adv_incorrect_mean": _ratio(adv[neg].sum(), n_neg),
            "adv_pos_mean": _ratio(adv[adv > 0].sum(), (adv > 0).sum()),
            "adv_neg_mean": _ratio(adv[adv < 0].sum(), (adv < 0).sum()),
            "adv_abs_mean": _ratio(adv.abs().sum(), n_all),
            "frac_tokens_adv_pos": _ratio((adv > 0).sum(), n_all),
            "frac_tokens_adv_neg": _ratio((adv < 0).sum(), n_all),
            "conservation_err": float(err.max()) if err.numel() else 0.0,
            "frac_groups_all_correct": _ratio((live & (correct_per_group == rows_per_group)).sum(), live.sum()),
            "frac_groups_all_wrong": _ratio((live & (correct_per_group == 0)).sum(), live.sum()),
            "entropy_correct_mean": _ratio(h[pos].sum(), n_pos),
            "entropy_incorrect_mean": _ratio(h[neg].sum(), n_neg),
        }
    )
    return out
