"""GTPO-token's and GRPO-S's inputs (Tan et al., arXiv 2508.04349): their checks and the reward bases of Eq. 3, 5, 9.

Not an equation module beyond :func:`shaping_bases` (the ``base_i`` that ``a1`` / ``b1`` multiply in Eq. 3, Eq. 5 and
Eq. 9: ``r`` for a correct response, the literal ``-1`` of Eq. 5 or ``r`` for an incorrect one, plus the GROP offset
of App. D). :func:`validate_shaping_inputs` names the problem of inputs that cannot be shaped;
:func:`check_token_values` is its ``[B, L]`` part, which the compiled kernels run themselves in their first pass and
call here only to raise the precise message. Deviations: none (the paper states no input contract); the choices
(negative base, the tolerance for negative entropies) are the knobs of :mod:`gtpo.algorithms.shaping_params`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["validate_shaping_inputs", "validate_with_params", "check_token_values", "check_responses", "shaping_bases"]


def validate_shaping_inputs(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    *,
    reward_threshold: float,
    negative_base: str,
    neg_entropy_tol: float,
    reward_offset: torch.Tensor | None = None,
    check_tokens: bool = True,
) -> None:
    """Raise ``ValueError`` naming the problem if the inputs cannot be shaped.

    Args:
        entropy: ``[B, L]`` float per-token entropy; only positions under the mask are checked (padding is ignored,
            NaN included).
        response_mask: ``[B, L]`` 0/1 (bool, int or float).
        rewards: ``[B]`` finite sequence rewards. Correct (``> reward_threshold``) rewards must be > 0 (they are the
            positive base); with ``negative_base="reward"`` incorrect rewards must be < 0.
        gid: ``[B]`` integer group ids in ``0 .. num_groups - 1``.
        num_groups: ``NG``.
        reward_threshold, negative_base, neg_entropy_tol: from the params.
        reward_offset: optional ``[B]`` finite additive reward (e.g. GROP penalty).
        check_tokens: also check the ``[B, L]`` values (mask in {0, 1}, entropy finite and >= -neg_entropy_tol on
            valid tokens). The kernels pass False and run the same checks in their first pass, calling
            :func:`check_token_values` only to raise the precise error.
    """
    if not isinstance(entropy, torch.Tensor) or entropy.dim() != 2:
        raise ValueError(f"entropy must be a [batch, response_len] tensor, got {_shape(entropy)}")
    if not entropy.is_floating_point():
        raise ValueError(f"entropy must be floating point, got dtype {entropy.dtype}")
    if not isinstance(response_mask, torch.Tensor) or tuple(response_mask.shape) != tuple(entropy.shape):
        raise ValueError(
            f"response_mask shape {_shape(response_mask)} does not match entropy shape {tuple(entropy.shape)}"
        )
    b = entropy.shape[0]
    if not isinstance(rewards, torch.Tensor) or tuple(rewards.shape) != (b,):
        raise ValueError(f"rewards must have shape [{b}] (one sequence reward per row), got {_shape(rewards)}")
    if not isinstance(gid, torch.Tensor) or tuple(gid.shape) != (b,):
        raise ValueError(f"gid must have shape [{b}], got {_shape(gid)}")
    if gid.is_floating_point() or gid.dtype == torch.bool:
        raise ValueError(f"gid must be an integer tensor, got dtype {gid.dtype}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups={num_groups!r}: must be a non-negative int")
    if b > 0 and (int(gid.min()) < 0 or int(gid.max()) >= num_groups):
        raise ValueError(f"gid values must lie in [0, {num_groups - 1}], got [{int(gid.min())}, {int(gid.max())}]")
    if check_tokens:
        check_token_values(entropy, response_mask, neg_entropy_tol)
    r = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {int((~torch.isfinite(r)).sum())} NaN/inf sequence reward(s)")
    correct = r > reward_threshold
    if bool((correct & (r <= 0)).any()):
        bad = float(r[correct & (r <= 0)][0])
        raise ValueError(
            f"reward {bad:g} is above reward_threshold={reward_threshold:g} (correct) but not > 0; the correct-side "
            "base is the reward itself, so correct rewards must be positive (raise reward_threshold)"
        )
    if negative_base == "reward" and bool((~correct & (r >= 0)).any()):
        bad = float(r[~correct & (r >= 0)][0])
        raise ValueError(
            f"reward {bad:g} is incorrect (<= reward_threshold={reward_threshold:g}) but not < 0; negative_base="
            "'reward' needs negative rewards for incorrect responses (use 'minus_one' for 0/1 rewards)"
        )
    if reward_offset is not None:
        if not isinstance(reward_offset, torch.Tensor) or tuple(reward_offset.shape) != (b,):
            raise ValueError(f"reward_offset must have shape [{b}], got {_shape(reward_offset)}")
        if not bool(torch.isfinite(reward_offset.detach()).all()):
            raise ValueError("reward_offset must be finite")


def validate_with_params(
    params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens: bool = True
) -> None:
    """:func:`validate_shaping_inputs` with the knobs of a ``GTPOParams`` or ``GRPOSParams``."""
    validate_shaping_inputs(
        entropy,
        response_mask,
        rewards,
        gid,
        num_groups,
        reward_threshold=params.reward_threshold,
        negative_base=params.negative_base,
        neg_entropy_tol=params.neg_entropy_tol,
        reward_offset=reward_offset,
        check_tokens=check_tokens,
    )


def check_token_values(entropy: torch.Tensor, response_mask: torch.Tensor, neg_entropy_tol: float) -> None:
    """The ``[B, L]`` value checks of :func:`validate_shaping_inputs` (mask in {0, 1}; entropy on valid tokens)."""
    if response_mask.dtype != torch.bool and bool(((response_mask != 0) & (response_mask != 1)).any()):
        raise ValueError("response_mask must hold only 0 and 1")
    valid = response_mask.bool()
    if valid.shape[-1] and bool(valid.any()):
        h = entropy.detach()
        n_nan = int((torch.isnan(h) & valid).sum())
        if n_nan:
            raise ValueError(f"entropy holds NaN on {n_nan} valid token(s)")
        n_inf = int((torch.isinf(h) & valid).sum())
        if n_inf:
            raise ValueError(f"entropy holds inf on {n_inf} valid token(s)")
        lowest = float(torch.where(valid, h, math.inf).min())
        if lowest < -neg_entropy_tol:
            raise ValueError(
                f"entropy holds negative value {lowest:.6g} on a valid token (below -neg_entropy_tol="
                f"{-neg_entropy_tol:g}); entropy is >= 0, were log-probs passed instead?"
            )


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def shaping_bases(
    rewards: torch.Tensor, correct: torch.Tensor, negative_base: str, reward_offset: torch.Tensor | None
) -> torch.Tensor:
    """Sequence base rewards ``[B]`` float64: ``r`` for correct, ``-1`` (or ``r``) for incorrect, plus the offset.

    The base multiplies ``a1`` (``b1``) in Eq. 3 / Eq. 5 (Eq. 9). ``negative_base`` is ``"minus_one"`` or ``"reward"``.
    """
    r = rewards.detach().to(torch.float64)
    neg_base = r if negative_base == "reward" else torch.full_like(r, -1.0)
    base = torch.where(correct, r, neg_base)
    if reward_offset is not None:
        base = base + reward_offset.detach().to(device=base.device, dtype=torch.float64)
    return base


def check_responses(responses, response_mask: torch.Tensor) -> None:
    """``conflict_mask`` needs integer token ids of the mask's shape."""
    if responses is None:
        raise ValueError("conflict_mask=True needs the response token ids (responses), got None")
    if not isinstance(responses, torch.Tensor) or tuple(responses.shape) != tuple(response_mask.shape):
        got = tuple(responses.shape) if isinstance(responses, torch.Tensor) else type(responses).__name__
        raise ValueError(f"responses shape {got} does not match response_mask {tuple(response_mask.shape)}")
    if responses.dtype.is_floating_point or responses.dtype == torch.bool:
        raise ValueError(f"responses must hold integer token ids, got dtype {responses.dtype}")
