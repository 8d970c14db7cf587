"""The estimators' float64 definitions: every formula evaluated as written, one ``[B, L]`` tensor at a time.

The tests' oracle for the estimators the recipe runs (:mod:`gtpo.algorithms.gtpo_token`, :mod:`gtpo.algorithms.grpo_s`,
:mod:`gtpo.algorithms.gtpo_traj`), which compute the same quantities from per-row sums over blocks of rows. Paper A
(Tan et al., arXiv 2508.04349) Eq. 3, 5, 6, 8, 9; paper B (Simoni et al., arXiv 2508.03772) §6.
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.conflict_tokens import conflict_runs
from gtpo.algorithms.grpo_s import GRPOSParams
from gtpo.algorithms.group_ops import group_mean_std, segment_sum
from gtpo.algorithms.gtpo_token import GTPOParams, reward_bases
from gtpo.algorithms.gtpo_traj import GTPOTrajOutput, entropy_filter

_F64 = torch.float64


def masked_group_mean_std(x, select, gid, num_groups, unbiased=True):
    """Mean and std over the selected tokens of each group (or of the whole batch when ``gid`` is None), two passes
    in float64; ``(mean, std, count)`` of shape ``[NG]`` (``[1]`` batch-wide)."""
    sel = select.to(torch.float64)
    xd = x.to(torch.float64) * sel
    if gid is None:
        gid = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        num_groups = 1
    count = segment_sum(sel.sum(-1), gid, num_groups)
    mean = segment_sum(xd.sum(-1), gid, num_groups) / count.clamp(min=1)
    centred = (x.to(torch.float64) - mean[gid][:, None]) * sel
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    std = (segment_sum((centred * centred).sum(-1), gid, num_groups) / denom).sqrt()
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return mean, std, count.to(torch.long)


@torch.no_grad()
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
    base = reward_bases(rewards, correct, params.negative_base, reward_offset).to(share.device)
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
    base = reward_bases(rewards, correct, params.negative_base, reward_offset).to(device)
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


@torch.no_grad()
def sequence_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Masked mean token entropy per response, ``Hbar_i`` (docs/ALGORITHMS.md §4.1).

    Args:
        entropy: ``[B, L]``; response_mask: ``[B, L]`` 0/1.

    Returns:
        ``[B]`` float64, detached; 0 for a zero-length response. Negative values clamp to 0, padding is never read.
    """
    m = response_mask.bool()
    h = torch.where(m, entropy.detach().to(torch.float64), 0.0).clamp_min(0.0)
    return h.sum(-1) / m.sum(-1).clamp(min=1).to(torch.float64)


@torch.no_grad()
def grpo_s_sequence_rewards(
    seq_entropy: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GRPOSParams | None = None,
    valid: torch.Tensor | None = None,
    reward_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO-S shaped sequence rewards (docs/ALGORITHMS.md §4.1)::

        r^+_i = b1 * base_i + b2 * Hbar_i / (sum_{O+} Hbar + eps) * n
        r^-_j = b1 * base_j - b2 * (1/(Hbar_j+eps)) / (sum_{O-} 1/(Hbar+eps) + eps) * m

    Args:
        seq_entropy: ``[B]`` ``Hbar`` (>= 0). rewards: ``[B]`` sequence rewards. gid: ``[B]``; num_groups: ``NG``.
        params: :class:`GRPOSParams` (None: the defaults).
        valid: ``[B]`` bool, rows that take part (default all); others get 0 and count in no ``n`` / ``m`` / sum.
        reward_offset: optional ``[B]`` additive reward added to both bases.

    Returns:
        ``[B]`` float64.
    """
    params = params or GRPOSParams()
    hbar = seq_entropy.detach().to(torch.float64).clamp_min(0.0)
    ok = torch.ones_like(hbar, dtype=torch.bool) if valid is None else valid.bool()
    correct = rewards.detach() > params.reward_threshold
    p, n_ = ok & correct, ok & ~correct
    zero = torch.zeros((), dtype=torch.float64, device=hbar.device)
    n_pos = segment_sum(p.to(torch.float64), gid, num_groups)[gid]
    n_neg = segment_sum(n_.to(torch.float64), gid, num_groups)[gid]
    inv = torch.where(n_, 1.0 / (hbar + params.eps), zero)
    s_pos = segment_sum(torch.where(p, hbar, zero), gid, num_groups)[gid]
    s_inv = segment_sum(inv, gid, num_groups)[gid]
    base = reward_bases(rewards, correct, params.negative_base, reward_offset).to(hbar.device)
    b1, b2 = float(params.beta1), float(params.beta2)
    r_pos = b1 * base + b2 * hbar / (s_pos + params.eps) * n_pos
    r_neg = b1 * base - b2 * inv / (s_inv + params.eps) * n_neg
    return torch.where(p, r_pos, torch.where(n_, r_neg, zero))


@torch.no_grad()
def grpo_s_reference(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GRPOSParams | None = None,
    reward_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-S advantages (Eq. 8, 9, §2.3) broadcast to the tokens, and diagnostics (inputs already validated).

    Same arguments, result and edge cases as :func:`gtpo.algorithms.entropy_shaping.grpo_s_advantages`.
    """
    params = params or GRPOSParams()
    device = entropy.device
    mask = response_mask.to(device)
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.to(device)
    if reward_offset is not None:
        reward_offset = reward_offset.to(device)
    nonempty = mask.bool().any(-1)
    correct = rewards.detach() > params.reward_threshold
    hbar = sequence_entropy(entropy, mask)
    shaped = grpo_s_sequence_rewards(hbar, rewards, gid, num_groups, params, nonempty, reward_offset)
    adv_seq = _group_normalised(shaped, correct, nonempty, gid, num_groups, params)
    adv = adv_seq[:, None] * mask.bool().to(torch.float64)

    # diagnostics
    p, n_ = nonempty & correct, nonempty & ~correct
    zero = torch.zeros((), dtype=torch.float64, device=device)
    n_pos = segment_sum(p.to(torch.float64), gid, num_groups)
    n_neg = segment_sum(n_.to(torch.float64), gid, num_groups)
    b1, b2 = float(params.beta1), float(params.beta2)
    base = reward_bases(rewards, correct, params.negative_base, reward_offset).to(device)
    w_pos = (shaped - b1 * base) / b2 if b2 > 0 else torch.zeros_like(shaped)
    w_neg = (b1 * base - shaped) / b2 if b2 > 0 else torch.zeros_like(shaped)
    err_pos = segment_sum(torch.where(p, shaped - b1 * base, zero), gid, num_groups) - b2 * n_pos
    err_neg = segment_sum(torch.where(n_, shaped - b1 * base, zero), gid, num_groups) + b2 * n_neg
    rows_per_group = segment_sum(nonempty.to(torch.float64), gid, num_groups)
    live = rows_per_group > 0
    n_live = max(int(live.sum()), 1)
    n_seq = max(int(nonempty.sum()), 1)
    diag = {
        "seq_weight_pos_mean": _masked_mean(w_pos, p),
        "seq_weight_pos_max": float(w_pos[p].max()) if bool(p.any()) else 0.0,
        "seq_weight_neg_mean": _masked_mean(w_neg, n_),
        "seq_weight_neg_max": float(w_neg[n_].max()) if bool(n_.any()) else 0.0,
        "adv_correct_mean": _masked_mean(adv_seq, p),
        "adv_incorrect_mean": _masked_mean(adv_seq, n_),
        "adv_abs_mean": _masked_mean(adv_seq.abs(), nonempty),
        "frac_seq_adv_pos": float((nonempty & (adv_seq > 0)).sum()) / n_seq,
        "frac_seq_adv_neg": float((nonempty & (adv_seq < 0)).sum()) / n_seq,
        "conservation_err": float(torch.cat([err_pos.abs(), err_neg.abs()]).max()) if num_groups else 0.0,
        "frac_groups_all_correct": float((live & (n_pos == rows_per_group)).sum()) / n_live,
        "frac_groups_all_wrong": float((live & (n_pos == 0)).sum()) / n_live,
        "seq_entropy_correct_mean": _masked_mean(hbar, p),
        "seq_entropy_incorrect_mean": _masked_mean(hbar, n_),
    }
    return adv.to(torch.float32), diag


def _masked_mean(x: torch.Tensor, sel: torch.Tensor) -> float:
    n = int(sel.sum())
    return float(torch.where(sel, x, 0.0).sum()) / n if n else 0.0


def _group_normalised(shaped, correct, nonempty, gid, num_groups, params: GRPOSParams) -> torch.Tensor:
    """``[B]`` group-normalised shaped rewards under ``params.norm_mode`` (0 on empty rows and constant fields).

    ``zero_fill`` whitens, per group, the field that is ``r^`` on the row's own polarity and 0 on the other one
    (Eq. 9), over the group's non-empty responses; ``joint`` whitens ``r^`` itself. A field whose std is
    ``<= zero_var_rtol * mean|field|`` (or with fewer than two responses) is constant: advantage 0.
    """
    unbiased = params.std == "unbiased"
    zero = torch.zeros((), dtype=shaped.dtype, device=shaped.device)
    fields = [(nonempty, shaped)]
    if params.norm_mode == "zero_fill":
        fields = [
            (nonempty & correct, torch.where(correct, shaped, zero)),
            (nonempty & ~correct, torch.where(correct, zero, shaped)),
        ]
    adv = torch.zeros_like(shaped)
    for rows, field in fields:
        mean, std, count = group_mean_std(field, gid, num_groups, unbiased=unbiased, valid=nonempty)
        abs_mean = segment_sum(torch.where(nonempty, field.abs(), zero), gid, num_groups) / count.clamp(min=1)
        constant = (count <= 1) | (std <= params.zero_var_rtol * abs_mean)
        own = (field - mean[gid]) / (std[gid] + params.eps)
        adv = torch.where(rows & ~constant[gid], own, adv)
    return adv


def conflict_runs_loop(responses, response_mask, gid, polarity) -> tuple[list[int], list[int], list[int]]:
    """``(fwd, bwd, last)`` per row, by Python loops over rows and positions (§6.2): a token conflicts when its
    (aligned position, token id) occurs in a positive and in a negative completion of its group; the leading run
    (from column 0) and the trailing run (from the last valid column back, right-aligned) stop at the first token that
    does not, or at a mask zero."""
    rows = range(responses.shape[0])
    valid = [[bool(x) for x in row] for row in response_mask.tolist()]
    tok = responses.tolist()
    last = [max((c for c, v in enumerate(valid[r]) if v), default=-1) for r in rows]
    pol = [int(x) for x in polarity.tolist()]
    groups = [int(x) for x in gid.tolist()]

    def pairs(r, backward):  # aligned position -> token id of every valid token
        cols = range(last[r], -1, -1) if backward else range(len(valid[r]))
        return {d: tok[r][c] for d, c in enumerate(cols) if valid[r][c]}

    runs = []
    for backward in (False, True):
        seen = {r: pairs(r, backward) for r in rows}
        lengths = []
        for r in rows:
            if pol[r] == 0:
                lengths.append(0)
                continue
            mates = [q for q in rows if groups[q] == groups[r]]
            n = 0
            for d in range(len(valid[r])):
                t = seen[r].get(d)  # None: a gap (or the end) stops the run
                if t is None:
                    break
                in_pos = any(pol[q] > 0 and seen[q].get(d) == t for q in mates)
                in_neg = any(pol[q] < 0 and seen[q].get(d) == t for q in mates)
                if not (in_pos and in_neg):
                    break
                n += 1
            lengths.append(n)
        runs.append(lengths)
    return runs[0], runs[1], last


@torch.no_grad()
def gtpo_traj_reference(response_mask, responses, entropy, gid, num_groups, params, adv, polarity, zero_var, h_ini):
    """GTPO-trajectory's token advantages and metrics after the group advantages, with dense ``[B, L]`` conflict
    weights built from :func:`conflict_runs_loop`: ``(advantages [B, L] float32, metrics, h_ini)``.

    Args:
        response_mask, responses, entropy: ``[B, L]``. gid: ``[B]``; num_groups: ``NG``. params: resolved.
        adv, polarity, zero_var: :func:`gtpo.algorithms.gtpo_traj.centred_advantages` of the scores. h_ini:
            ``<H>_ini`` or None (measured here when the gate needs it).
    """
    valid = response_mask.bool()
    num_rows, length = valid.shape
    fwd, bwd, last = conflict_runs_loop(responses, response_mask, gid, polarity)
    lam_c = torch.where(polarity > 0, params.lam_pos, params.lam_neg).to(torch.float32)
    lam_c = torch.where(polarity == 0, torch.ones_like(lam_c), lam_c)
    in_fwd = torch.zeros(num_rows, length, dtype=torch.bool)
    in_bwd = torch.zeros_like(in_fwd)
    for r in range(num_rows):
        in_fwd[r, : fwd[r]] = True
        for d in range(bwd[r]):
            in_bwd[r, last[r] - d] = True
    lam = valid.to(torch.float32) * torch.where(in_fwd, lam_c[:, None], 1.0) * torch.where(in_bwd, lam_c[:, None], 1.0)
    n_conflict = (in_fwd | in_bwd).sum(-1).to(torch.float64)
    overlap = (in_fwd & in_bwd).sum(-1).to(torch.float64)
    counted = n_conflict
    if params.nconf_count == "official":
        counted = torch.maximum(torch.tensor(fwd), torch.tensor(bwd)).to(torch.float64)
    n_conf = torch.where(polarity != 0, counted.clamp(min=1), torch.ones_like(counted)).long()
    del overlap
    h_sum = torch.where(valid, entropy.detach().to(torch.float64), 0.0).sum(-1)
    n_valid = valid.sum(-1).to(torch.float64)
    h_bar = (h_sum / n_valid.clamp(min=1)).to(torch.float32)
    valid_rows = n_valid > 0
    if params.use_ini_gate and h_ini is None:
        h_ini = float(h_bar[valid_rows].mean()) if bool(valid_rows.any()) else 0.0
    delta = entropy_filter(h_bar, params.tau, params.use_ini_gate, h_ini)

    shaped = delta * (adv - params.gamma * h_bar)
    if params.skip_zero_adv_groups:
        shaped = torch.where(zero_var, torch.zeros_like(shaped), shaped)
    if params.agg == "code_sum":
        shaped = shaped * segment_sum(torch.ones_like(shaped), gid, num_groups)[gid]
    row_scale = shaped / n_conf.to(torch.float32) if params.divide_by_nconf else shaped
    advantages = lam * row_scale[:, None]

    n_rows = max(int(valid_rows.sum()), 1)
    n_tok = max(float(n_valid.sum()), 1.0)
    active = polarity != 0
    metrics = {
        "conflict_token_frac": float(n_conflict.sum()) / n_tok,
        "pos_conflict_token_frac": float(n_conflict[polarity > 0].sum()) / n_tok,
        "neg_conflict_token_frac": float(n_conflict[polarity < 0].sum()) / n_tok,
        "conflict_traj_frac": float(((n_conflict > 0) & valid_rows).sum()) / n_rows,
        "filtered_traj_frac": float(((delta == 0) & valid_rows).sum()) / n_rows,
        "active_traj_frac": float((active & valid_rows).sum()) / n_rows,
        "zero_var_traj_frac": float((zero_var & valid_rows).sum()) / n_rows,
        "mean_entropy": float(h_bar[valid_rows].mean()) if bool(valid_rows.any()) else 0.0,
        "shaped_adv_mean": float(shaped[valid_rows].mean()) if bool(valid_rows.any()) else 0.0,
        "adv_abs_mean": float(advantages.abs().to(torch.float64).sum()) / n_tok,
        "filter_on": float(not (params.use_ini_gate and h_ini is not None and h_ini > params.tau)),
    }
    if h_ini is not None:
        metrics["h_ini"] = float(h_ini)
    return advantages, metrics, h_ini
