"""GTPO's entropy-shaped token rewards (Tan et al., arXiv 2508.04349, Eq. 3 and Eq. 5), direct float64 form.

Eq. 3 (correct responses) and Eq. 5 (incorrect responses), with the eps guards of Remark 2.1::

    r+_{i,t} = a1 * base_i + a2 * H_{i,t} / (sum_{k in O+_t} H_{k,t} + eps) * d_t
    r-_{j,t} = a1 * base_j - a2 * (1/(H_{j,t}+eps)) / (sum_{k in O-_t} 1/(H_{k,t}+eps) + eps) * h_t

``d_t`` / ``h_t`` count the correct / incorrect responses active at position ``t`` (``response_mask[:, t] == 1``;
positions are absolute offsets from the response start). ``weight_scope`` says over which responses the sums and
counts run: ``"batch"`` (paper §4, "compares entropy across different problems": every correct / incorrect response
of the batch) or ``"group"`` (the equations as typeset: the responses of the same prompt).

These functions state the equations; the estimator (:mod:`gtpo.algorithms.gtpo_token`) evaluates the same
quantities chunk by chunk and never materialises them in float64.
"""

from __future__ import annotations

import torch

from gtpo.algorithms.entropy_shaping import GTPOParams, shaping_bases
from gtpo.algorithms.group_ops import segment_sum

__all__ = ["polarity_segments", "weight_segments", "active_counts", "entropy_shares", "gtpo_shaped_rewards"]


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
    counts = segment_sum(response_mask.bool().to(torch.float64), seg, 2 * num_groups)
    return counts[:num_groups], counts[num_groups:]


def _shares_and_counts(entropy, m, correct, gid, num_groups, eps, weight_scope):
    """Entropy share and active count of each token's polarity at its position (``[B, L]`` float64, 0 on padding).

    One scatter-add over the weight segments gives ``sum_{O+_t} H`` and ``sum_{O-_t} 1/(H+eps)`` together, another
    the counts ``d_t`` / ``h_t``. Returns ``(share, count)``.
    """
    seg, n_seg = weight_segments(correct, gid, num_groups, weight_scope)
    m64 = m.to(torch.float64)
    h = torch.where(m, entropy.detach().to(torch.float64), 0.0).clamp_min_(0.0)
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
    signed_a2 = (torch.where(correct, 1.0, -1.0).to(torch.float64) * a2)[:, None]
    return share.mul_(cnt).mul_(signed_a2).add_((a1 * base)[:, None]).mul_(m.to(torch.float64))
