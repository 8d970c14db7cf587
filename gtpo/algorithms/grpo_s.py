"""GRPO-S's definition: sequence-level entropy-shaped advantages (Tan et al., arXiv 2508.04349, §2.3, Eq. 8, 9).

Float64 torch, as the paper writes it: the documented definition, the oracle of the kernel's tests
(:mod:`gtpo.algorithms.grpo_s_kernel`), and what :func:`gtpo.algorithms.entropy_shaping.grpo_s_advantages`
evaluates where the kernel cannot run (tensors not on the CPU, numba missing or failing).

- Eq. 8: sequence entropy ``Hbar_k = (1/|o_k|) sum_t H_{k,t}`` (masked mean of the old policy's token entropy).
- Eq. 9 (with the eps guards of Remark 2.1)::

      r^+_i = b1 * base_i + b2 * Hbar_i / (sum_{O+} Hbar + eps) * n
      r^-_j = b1 * base_j - b2 * (1/(Hbar_j+eps)) / (sum_{O-} 1/(Hbar+eps) + eps) * m

  over the ``n`` correct / ``m`` incorrect responses of the prompt's group, with r^-_i = r^+_j = 0.
- Advantages "computed analogously to Eq. (1) ... normalizing over the G sequences in the group" (§2.3):
  ``norm_mode="zero_fill"`` (default) whitens the r^+ field and the r^- field (zeros included) over the group's G
  responses; ``"joint"`` whitens the signed r^ (the recipe's earlier reading). Both reduce to verl's GRPO at
  ``beta2 = 0`` (A2-T2). The loss (Eq. 10, 11) is :mod:`gtpo.algorithms.losses`.

Choices where the paper is silent (the deviations) are listed in :mod:`gtpo.algorithms.shaping_params` (std
convention, eps, zero-variance rule, negative base, empty responses, single-response groups).
"""

from __future__ import annotations

import torch

from gtpo.algorithms.group_ops import group_mean_std, segment_sum
from gtpo.algorithms.shaping_inputs import shaping_bases
from gtpo.algorithms.shaping_params import GRPOSParams

__all__ = ["sequence_entropy", "grpo_s_sequence_rewards", "grpo_s_reference"]


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
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset).to(hbar.device)
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
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset).to(device)
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
