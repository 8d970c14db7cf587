"""GRPO-S policy loss (Tan et al., arXiv 2508.04349; docs/ALGORITHMS.md §4.1, Chinese-notes Eq. 9–10).

Sequence importance weight: the **arithmetic** mean of the token ratios over the response's valid tokens,
``w_i = (1/|o_i|) sum_t exp(logp_{i,t} - logp_old_{i,t})`` (not GSPO's geometric mean). The clipped surrogate acts on
``w_i``::

    l_i = -min(w_i * A_i, clip(w_i, 1 - clip_low, 1 + clip_high) * A_i)

and the objective is the mean over sequences, ``(1/G) sum_i l_i``.

Construction for verl: :func:`grpo_s_loss_matrix` puts ``l_i`` on every valid token of response ``i``. verl's
``agg_loss(..., loss_agg_mode="seq-mean-token-mean")`` first averages each row over its valid tokens (giving ``l_i``
back exactly, up to verl's 1e-8 in that denominator) and then averages over the sequences of the global
mini-batch, which is the paper's ``1/G`` mean. ``token-mean`` instead weights ``l_i`` by ``|o_i|``, and
``seq-mean-token-sum`` by ``|o_i|`` again; both are available but not the paper's objective.

Gradient: while ``w_i`` is inside its clip range (or on the unclipped side of it),
``d l_i / d logp_{i,t} = -A_i * ratio_{i,t} / |o_i|``; when ``A_i > 0`` and ``w_i > 1 + clip_high``, or ``A_i < 0``
and ``w_i < 1 - clip_low``, the whole sequence gets zero gradient. There is no dual clip (``clip_ratio_c``): the
paper's objective has none. Per-token log-ratios are clamped to ``[-20, 20]`` before ``exp`` (numerical guard, as
verl's vanilla loss). If ``advantages`` are not constant along a row (not produced by GRPO-S), each token uses its
own advantage with the shared sequence weight.
"""

from __future__ import annotations

import torch

__all__ = ["sequence_ratio", "grpo_s_loss_matrix"]

_LOG_RATIO_CLAMP = 20.0


def sequence_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Arithmetic-mean sequence importance weight ``w_i`` (differentiable w.r.t. ``log_prob``).

    Args:
        log_prob: ``[B, L]`` current-policy log-probs of the sampled tokens.
        old_log_prob: ``[B, L]`` old-policy log-probs (treated as constants).
        response_mask: ``[B, L]`` 0/1 or bool.

    Returns:
        ``[B]`` weights; 0 for a zero-length response. Padding (even NaN there) is never read.
    """
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
    """Per-token matrix holding each response's clipped sequence loss ``l_i`` on its valid tokens.

    Args:
        log_prob: ``[B, L]`` current log-probs (carry gradient). old_log_prob: ``[B, L]``.
        advantages: ``[B, L]`` token advantages (GRPO-S: the sequence advantage on every valid token).
        response_mask: ``[B, L]``. clip_low / clip_high: ``w`` is clipped to ``[1 - clip_low, 1 + clip_high]``.

    Returns:
        ``(loss_mat [B, L], stats)``; ``loss_mat`` is 0 on padding. ``stats`` (detached tensors): ``seq_ratio``
        ``[B]``, ``seq_clipped_high`` / ``seq_clipped_low`` ``[B]`` bool (the clipped side is active: zero gradient),
        ``seq_valid`` ``[B]`` bool (non-empty rows).
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
    surr = w * adv
    surr_clipped = w.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss_mat = -torch.minimum(surr, surr_clipped)
    loss_mat = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    seq_valid = m.any(-1)
    wd = w.detach().squeeze(-1)
    seq_adv = adv.sum(-1) / m.sum(-1).clamp(min=1).to(adv.dtype)
    stats = {
        "seq_ratio": wd,
        "seq_clipped_high": seq_valid & (seq_adv > 0) & (wd > 1.0 + clip_high),
        "seq_clipped_low": seq_valid & (seq_adv < 0) & (wd < 1.0 - clip_low),
        "seq_valid": seq_valid,
    }
    return loss_mat, stats
