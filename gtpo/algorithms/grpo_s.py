"""GRPO-S: sequence-level advantages shaped by the mean entropy (Tan et al., arXiv 2508.04349, §2.3, Eq. 8-11).

Specification: docs/ALGORITHMS.md §4. Knobs: ``algorithm.grpo_s`` (:class:`GRPOSParams`); the conventions it shares
with GTPO-token (the reward base, the input checks) are :mod:`gtpo.algorithms.gtpo_token`'s. This file holds the knobs,
the definition (:func:`grpo_s_definition`, float64 torch), the entry point (:func:`grpo_s_advantages`: CPU tensors
go to the compiled kernel, :mod:`gtpo.algorithms.kernels`) and the loss (:func:`grpo_s_policy_loss`).

- Eq. 8: sequence entropy ``Hbar_k = (1/|o_k|) sum_t H_{k,t}`` (masked mean of the old policy's token entropy).
- Eq. 9 (with the eps guards of Remark 2.1), over the ``n`` correct / ``m`` incorrect responses of the prompt's
  group, with r^-_i = r^+_j = 0::

      r^+_i = b1 * base_i + b2 * Hbar_i / (sum_{O+} Hbar + eps) * n
      r^-_j = b1 * base_j - b2 * (1/(Hbar_j+eps)) / (sum_{O-} 1/(Hbar+eps) + eps) * m

- Advantages "computed analogously to Eq. (1) ... normalizing over the G sequences in the group" (§2.3):
  ``norm_mode="zero_fill"`` (default) whitens the r^+ field and the r^- field (zeros included) over the group's G
  responses, a correct response taking A^+, an incorrect one A^-; ``joint`` whitens the signed r^. Both reduce to
  verl's GRPO at ``beta2 = 0`` (A2-T2). Each response's advantage is broadcast to its valid tokens.
- Eq. 10, 11 (the loss, :func:`grpo_s_policy_loss`): the sequence weight is the **arithmetic** mean of the token
  ratios, ``w_i = (1/|o_i|) sum_t exp(logp - logp_old)`` (not GSPO's geometric mean), clipped per sequence:
  ``l_i = -min(w_i A_i, clip(w_i, 1 - clip_low, 1 + clip_high) A_i)``, placed on every valid token of response
  ``i``, so verl's ``seq-mean-token-mean`` aggregation gives the paper's ``(1/G) sum_i l_i``.

Deliberate choices where the paper is silent: those of GTPO-token (std convention, eps, zero-variance rule,
negative base, negative-entropy tolerance, empty responses), and a group with a single non-empty response gets
advantage 0 (verl's GRPO returns the raw reward there). The loss has no dual clip (the paper's objective has
none); per-token log-ratios are clamped to ``[-20, 20]`` before ``exp`` (as verl's vanilla loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo.algorithms.group_ops import group_mean_std, segment_sum
from gtpo.algorithms.gtpo_token import NEGATIVE_BASES, STD_CHOICES, check_inputs, check_token_values, reward_bases
from gtpo.algorithms.kernel_dispatch import kernel_guard, kernel_on
from gtpo.knobs import check_choice, check_real

__all__ = [
    "GRPOSParams",
    "grpo_s_advantages",
    "grpo_s_definition",
    "grpo_s_loss_matrix",
    "grpo_s_policy_loss",
    "grpo_s_sequence_rewards",
    "sequence_entropy",
    "sequence_ratio",
]

_F64 = torch.float64
NORM_MODES = ("zero_fill", "joint")
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class GRPOSParams:
    """``algorithm.grpo_s``; the defaults are the paper's (docs/ALGORITHMS.md §4.2, §11).

    Attributes:
        beta1: weight of the sequence reward (paper 1.0).
        beta2: weight of the sequence-entropy term (paper 0.1).
        eps: entropy guard (``1/(Hbar+eps)``, ``sum + eps``) and the group-std guard ``(std + eps)`` as in verl GRPO.
        reward_threshold: a response is correct iff its sequence reward is ``> reward_threshold``.
        norm_mode: ``zero_fill`` (paper §2.3, Eq. 9) or ``joint`` (one set of the signed shaped rewards per group).
        std: ``unbiased`` (verl GRPO's ``torch.std``) or ``population`` group std.
        negative_base: ``minus_one`` or ``reward``, as GTPO-token's.
        zero_var_rtol: a group field with ``std <= zero_var_rtol * mean|r^|`` gets advantage 0.
        neg_entropy_tol: entropies in ``[-neg_entropy_tol, 0)`` count as 0; lower values raise.
    """

    beta1: float = 1.0
    beta2: float = 0.1
    eps: float = 1e-6
    reward_threshold: float = 0.0
    norm_mode: str = "zero_fill"
    std: str = "unbiased"
    negative_base: str = "minus_one"
    zero_var_rtol: float = 1e-5
    neg_entropy_tol: float = 0.1

    def __post_init__(self) -> None:
        check_real("beta1", self.beta1, lo=0.0)
        check_real("beta2", self.beta2, lo=0.0)
        if float(self.beta1) + float(self.beta2) <= 0.0:
            raise ValueError(f"beta1={self.beta1!r}: beta1 + beta2 must be > 0, else every advantage is 0")
        check_real("eps", self.eps, lo=0.0, lo_open=True, hi=1e-2)
        check_real("reward_threshold", self.reward_threshold)
        check_choice("norm_mode", self.norm_mode, NORM_MODES)
        check_choice("std", self.std, STD_CHOICES)
        check_choice("negative_base", self.negative_base, NEGATIVE_BASES)
        check_real("zero_var_rtol", self.zero_var_rtol, lo=0.0, hi=1.0)
        check_real("neg_entropy_tol", self.neg_entropy_tol, lo=0.0)


@torch.no_grad()
def grpo_s_advantages(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GRPOSParams | None = None,
    reward_offset: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-S advantages (Eq. 8, 9, §2.3) broadcast to the tokens, and diagnostics (the estimator contract and the
    arguments of :func:`gtpo.algorithms.gtpo_token.gtpo_token_advantages`; ``responses`` unused).

    Edge cases (docs/ALGORITHMS.md §4.3): an all-correct (all-wrong) group keeps a non-zero entropy-rank advantage
    unless its ``Hbar`` are all equal (then 0, as GRPO); uniform ``Hbar`` or ``beta2 = 0`` give verl GRPO's
    advantages (up to the eps in the std guard) for groups of two or more; a group with a single non-empty response
    gets 0; zero-length responses are left out of ``n``, ``m``, the sums and the group statistics, and get 0;
    ``Hbar = 0`` on the correct side gives weight 0, on the incorrect side the largest inverse weight (finite through
    eps); entropies in ``[-neg_entropy_tol, 0)`` count as 0 in ``Hbar``.

    Returns:
        ``(advantages [B, L] float32, zero on padding; diagnostics)``: ``seq_weight_{pos,neg}_{mean,max}``,
        ``adv_correct_mean``, ``adv_incorrect_mean``, ``adv_abs_mean``, ``frac_seq_adv_pos``, ``frac_seq_adv_neg``,
        ``conservation_err``, ``frac_groups_all_correct``, ``frac_groups_all_wrong``, ``seq_entropy_correct_mean``,
        ``seq_entropy_incorrect_mean``; ``kernel_compile_s`` on the call that compiled the kernel.
    """
    params = params or GRPOSParams()
    check_inputs(entropy, response_mask, rewards, gid, num_groups, reward_offset, params)
    correct = rewards.detach() > params.reward_threshold
    base = reward_bases(rewards, correct, params.negative_base, reward_offset)
    if entropy.device.type == "cpu" and response_mask.device.type == "cpu" and kernel_on("grpo_s"):
        with kernel_guard("grpo_s"):  # numba missing or failing: the definition below
            from gtpo.algorithms import kernels

            try:
                return kernels.grpo_s_kernel(
                    entropy, response_mask, correct.cpu(), base.cpu(), gid.cpu(), num_groups, params
                )
            except kernels.BadValues:  # the check below names the problem
                pass
    check_token_values(entropy, response_mask.to(entropy.device), params.neg_entropy_tol)
    return grpo_s_definition(entropy, response_mask, rewards, gid, num_groups, params, reward_offset)


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
def grpo_s_definition(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GRPOSParams | None = None,
    reward_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-S advantages (Eq. 8, 9, §2.3) broadcast to the tokens, and diagnostics (inputs already validated).

    Same arguments, result and edge cases as :func:`grpo_s_advantages`.
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


def sequence_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` arithmetic-mean sequence weight ``w_i`` (differentiable w.r.t. ``log_prob``; 0 for an empty row;
    padding, even NaN there, never read)."""
    m = response_mask.bool()
    log_ratio = torch.where(m, log_prob - old_log_prob.detach(), torch.zeros_like(log_prob))
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    ratio = torch.where(m, ratio, torch.zeros_like(ratio))
    return ratio.sum(-1) / m.sum(-1).clamp(min=1).to(ratio.dtype)


def grpo_s_loss_matrix(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 10, 11: each response's clipped sequence loss ``l_i`` on its valid tokens, ``[B, L]`` (0 on padding).

    Aggregated with verl's ``seq-mean-token-mean`` it is the paper's ``(1/G) sum_i l_i``. While ``w_i`` is inside its
    clip range (or on the unclipped side of it), ``d l_i / d logp_{i,t} = -A_i ratio_{i,t} / |o_i|``; when
    ``A_i > 0`` and ``w_i > 1 + clip_high``, or ``A_i < 0`` and ``w_i < 1 - clip_low``, the whole sequence gets zero
    gradient. If ``advantages`` are not constant along a row, each token uses its own advantage with the shared
    sequence weight.

    Returns:
        ``(loss_mat, stats)``; ``stats`` (detached): ``seq_ratio`` ``[B]``, ``seq_clipped_high`` /
        ``seq_clipped_low`` ``[B]`` bool (the clipped side is active: zero gradient), ``seq_valid`` ``[B]`` bool.
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            "log_prob, old_log_prob, advantages and response_mask must share one [batch, response_len] shape, got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(advantages.shape)}, "
            f"{tuple(response_mask.shape)}"
        )
    if not (0.0 <= clip_low < 1.0) or not clip_high >= 0.0:
        raise ValueError(f"clip_low={clip_low}, clip_high={clip_high}: need 0 <= clip_low < 1 and clip_high >= 0")
    m = response_mask.bool()
    adv = torch.where(m, advantages.detach(), torch.zeros_like(advantages))
    w = sequence_ratio(log_prob, old_log_prob, m)[:, None]
    surrogate = -torch.minimum(w * adv, w.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    loss_mat = torch.where(m, surrogate, torch.zeros_like(surrogate))
    valid = m.any(-1)
    ratio = w.detach().squeeze(-1)
    seq_adv = adv.sum(-1) / m.sum(-1).clamp(min=1).to(adv.dtype)
    stats = {
        "seq_ratio": ratio,
        "seq_clipped_high": valid & (seq_adv > 0) & (ratio > 1.0 + clip_high),
        "seq_clipped_low": valid & (seq_adv < 0) & (ratio < 1.0 - clip_low),
        "seq_valid": valid,
    }
    return loss_mat, stats


def grpo_s_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-S's policy loss (:func:`grpo_s_loss_matrix`) and its metrics, python floats of this micro-batch:
    ``seq_ratio_mean|min|max``, ``seq_clipfrac``, ``seq_clipfrac_high``, ``seq_clipfrac_low``, ``ppo_kl``."""
    loss_mat, stats = grpo_s_loss_matrix(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high)
    m = response_mask.bool()
    valid = stats["seq_valid"]
    high, low = int(stats["seq_clipped_high"].sum()), int(stats["seq_clipped_low"].sum())
    n_seq, n_tok = max(int(valid.sum()), 1), max(int(m.sum()), 1)
    kl = torch.where(m, (old_log_prob - log_prob).detach(), torch.zeros_like(log_prob)).sum() / n_tok
    seen = stats["seq_ratio"][valid]
    metrics = {
        "seq_ratio_mean": float(seen.mean()) if seen.numel() else 1.0,
        "seq_ratio_min": float(seen.min()) if seen.numel() else 1.0,
        "seq_ratio_max": float(seen.max()) if seen.numel() else 1.0,
        "seq_clipfrac": (high + low) / n_seq,
        "seq_clipfrac_high": high / n_seq,
        "seq_clipfrac_low": low / n_seq,
        "ppo_kl": float(kl),
    }
    return loss_mat, metrics
