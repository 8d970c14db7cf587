"""Entropy-shaped rewards and advantages of GTPO (token level) and GRPO-S (sequence level).

Paper: Tan et al., "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy",
arXiv 2508.04349 (docs/ALGORITHMS.md §3, §4). Equation numbers follow the paper's textpolicy numbering.

Implemented:

- GTPO-token shaped rewards (Eq. 3, successful responses; Eq. 5, failed responses)::

      r+_{i,t} = a1 * r_i + a2 * H_{i,t} / (sum_{k in O+_t} H_{k,t} + eps) * d_t
      r-_{j,t} = a1 * (-1) - a2 * (1/(H_{j,t}+eps)) / (sum_{k in O-_t} 1/(H_{k,t}+eps) + eps) * h_t

  ``d_t`` / ``h_t`` count the correct / incorrect responses of the group still active at position ``t``
  (``response_mask[:, t] == 1``; positions are absolute offsets from the response start).
- GTPO advantages (Eq. 6): each set of shaped token rewards is whitened, ``(x - mean) / (std + eps)``.
  ``norm_mode="split"`` whitens the correct and the incorrect tokens separately (every secondary source);
  ``norm_mode="joint"`` whitens them together (keeps the sign, docs/ALGORITHMS.md §3.7). ``norm_scope`` picks one
  set per group or one per batch.
- GRPO-S shaped sequence rewards and group-normalised advantages (docs/ALGORITHMS.md §4.1) on the masked mean token
  entropy ``Hbar_i``, broadcast to the response's tokens.
- Optional composition of GTPO with GTPO-trajectory conflict weights (arXiv 2508.03772, §6.2): the final token
  advantages are multiplied by ``lam`` from :func:`gtpo.algorithms.trajectory.conflict_weights`, polarity =
  correctness.

The entropy is the old policy's per-token entropy and never carries gradient (Remark 2.5): every function here runs
under ``torch.no_grad()`` and detaches its inputs. Arithmetic is float64 inside; results come back as float32.

Deliberate choices where the sources are silent (each one a knob or documented behaviour):

- ``std="unbiased"`` by default (verl's ``masked_whiten`` and ``torch.std``, used by the only verl port and by
  verl's GRPO): it makes GRPO-S reduce exactly to verl's GRPO (A2-T2). Over thousands of tokens the two conventions
  agree to 1e-4; ``"population"`` (textpolicy) is available.
- Zero-variance tolerance: a whitening set whose std is ``<= zero_var_rtol * mean(|x|)`` (or that holds fewer than two
  values) gets advantage 0 (docs/ALGORITHMS.md §3.6 last bullet): the ε guards alone make "equal" shaped rewards
  differ by ~ ``a2 * eps / H``, and dividing such a spread by its own std would turn rounding into unit advantages.
- Negative base: ``negative_base="minus_one"`` (default) uses the literal -1 of Eq. 5 for every incorrect response,
  whatever its reward (0/1 and ±1 verifiers alike); ``"reward"`` uses the incorrect response's own (negative) reward,
  so a length penalty that a ±1 reward function folded into the reward reaches it. Penalties passed separately as
  ``reward_offset`` (GROP, §5) are added to the base on both sides under either choice, then scaled by ``a1``.
- Negative entropies within ``neg_entropy_tol`` of 0 (low-precision rounding of a near-deterministic token) are
  clamped to 0; anything more negative raises (it usually means log-probs were passed instead of entropies).
- Zero-length responses (no valid token) take no part: they count in no ``d_t`` / ``h_t``, no ``n`` / ``m`` and no
  normalisation set, and get advantage 0.
- GRPO-S groups with one (non-empty) response get advantage 0; verl's GRPO instead returns the raw reward for them
  (mean 0, std 1 convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from gtpo.algorithms.group_ops import group_mean_std, masked_group_mean_std, segment_sum

__all__ = [
    "GTPOParams",
    "GRPOSParams",
    "validate_shaping_inputs",
    "active_counts",
    "entropy_shares",
    "gtpo_shaped_rewards",
    "whiten_sets",
    "gtpo_token_advantages",
    "sequence_entropy",
    "grpo_s_sequence_rewards",
    "grpo_s_advantages",
]

_STD_CHOICES = ("unbiased", "population")
_NEG_BASE_CHOICES = ("minus_one", "reward")


def _check_real(name: str, value, *, lo: float | None = None, lo_open: bool = False, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name}={value!r}: must be a finite real number")
    v = float(value)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name}={value!r}: must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v >= hi:
        raise ValueError(f"{name}={value!r}: must be < {hi}")


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {list(choices)}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false")


@dataclass(frozen=True)
class GTPOParams:
    """Knobs of GTPO-token (``algorithm.gtpo``); defaults are the paper's (docs/ALGORITHMS.md §3.5, §11).

    Attributes:
        alpha1: weight of the sequence reward (paper 1.0).
        alpha2: weight of the entropy term (paper 0.1).
        eps: entropy guard in ``1/(H+eps)`` and ``sum + eps`` (Remark 2.1) and in the whitening denominator.
        reward_threshold: a response is correct iff its sequence reward is ``> reward_threshold``.
        norm_mode: ``"split"`` (correct and incorrect tokens whitened separately) or ``"joint"``.
        norm_scope: ``"group"`` (statistics per prompt group) or ``"batch"`` (one set over the batch).
        std: ``"unbiased"`` (Bessel-corrected) or ``"population"`` std in the whitening.
        negative_base: ``"minus_one"`` (literal -1 of Eq. 5) or ``"reward"`` (the incorrect response's own reward).
        zero_var_rtol: a whitening set with ``std <= zero_var_rtol * mean|x|`` is treated as constant (advantage 0).
        neg_entropy_tol: entropies in ``[-neg_entropy_tol, 0)`` are rounding and clamp to 0; lower values raise.
        conflict_mask: multiply the final advantages by GTPO-trajectory's conflict weights (needs ``responses``).
        conflict_lam_pos: conflict-token weight of correct responses (paper B: 2).
        conflict_lam_neg: conflict-token weight of incorrect responses (paper B: 0).
    """

    alpha1: float = 1.0
    alpha2: float = 0.1
    eps: float = 1e-6
    reward_threshold: float = 0.0
    norm_mode: str = "split"
    norm_scope: str = "group"
    std: str = "unbiased"
    negative_base: str = "minus_one"
    zero_var_rtol: float = 1e-5
    neg_entropy_tol: float = 0.1
    conflict_mask: bool = False
    conflict_lam_pos: float = 2.0
    conflict_lam_neg: float = 0.0

    def __post_init__(self) -> None:
        _check_real("alpha1", self.alpha1, lo=0.0)
        _check_real("alpha2", self.alpha2, lo=0.0)
        if float(self.alpha1) + float(self.alpha2) <= 0.0:
            raise ValueError(f"alpha1={self.alpha1!r}: alpha1 + alpha2 must be > 0, else every advantage is 0")
        _check_real("eps", self.eps, lo=0.0, lo_open=True, hi=1e-2)
        _check_real("reward_threshold", self.reward_threshold)
        _check_choice("norm_mode", self.norm_mode, ("split", "joint"))
        _check_choice("norm_scope", self.norm_scope, ("group", "batch"))
        _check_choice("std", self.std, _STD_CHOICES)
        _check_choice("negative_base", self.negative_base, _NEG_BASE_CHOICES)
        _check_real("zero_var_rtol", self.zero_var_rtol, lo=0.0, hi=1.0)
        _check_real("neg_entropy_tol", self.neg_entropy_tol, lo=0.0)
        _check_bool("conflict_mask", self.conflict_mask)
        _check_real("conflict_lam_pos", self.conflict_lam_pos, lo=0.0)
        _check_real("conflict_lam_neg", self.conflict_lam_neg, lo=0.0)


@dataclass(frozen=True)
class GRPOSParams:
    """Knobs of GRPO-S (``algorithm.grpo_s``); defaults are the paper's (docs/ALGORITHMS.md §4.2, §11).

    Attributes:
        beta1: weight of the sequence reward (paper 1.0).
        beta2: weight of the sequence-entropy term (paper 0.1).
        eps: entropy guard (``1/(Hbar+eps)``, ``sum + eps``) and the group-std guard ``(std + eps)`` as in verl GRPO.
        reward_threshold: a response is correct iff its sequence reward is ``> reward_threshold``.
        std: ``"unbiased"`` (verl GRPO's ``torch.std``) or ``"population"`` group std.
        negative_base: ``"minus_one"`` or ``"reward"``, as in :class:`GTPOParams`.
        zero_var_rtol: a group with ``std <= zero_var_rtol * mean|r_hat|`` gets advantage 0.
        neg_entropy_tol: entropies in ``[-neg_entropy_tol, 0)`` clamp to 0; lower values raise.
    """

    beta1: float = 1.0
    beta2: float = 0.1
    eps: float = 1e-6
    reward_threshold: float = 0.0
    std: str = "unbiased"
    negative_base: str = "minus_one"
    zero_var_rtol: float = 1e-5
    neg_entropy_tol: float = 0.1

    def __post_init__(self) -> None:
        _check_real("beta1", self.beta1, lo=0.0)
        _check_real("beta2", self.beta2, lo=0.0)
        if float(self.beta1) + float(self.beta2) <= 0.0:
            raise ValueError(f"beta1={self.beta1!r}: beta1 + beta2 must be > 0, else every advantage is 0")
        _check_real("eps", self.eps, lo=0.0, lo_open=True, hi=1e-2)
        _check_real("reward_threshold", self.reward_threshold)
        _check_choice("std", self.std, _STD_CHOICES)
        _check_choice("negative_base", self.negative_base, _NEG_BASE_CHOICES)
        _check_real("zero_var_rtol", self.zero_var_rtol, lo=0.0, hi=1.0)
        _check_real("neg_entropy_tol", self.neg_entropy_tol, lo=0.0)


# --------------------------------------------------------------------------------------------------------------------
# validation


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
            valid tokens). The fast estimators pass False and run the same checks chunk by chunk, calling this
            function with True only to raise the precise error.
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
        _check_token_values(entropy, response_mask, neg_entropy_tol)
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


def _validate_with_params(
    params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens: bool = True
) -> None:
    """:func:`validate_shaping_inputs` with the knobs of a :class:`GTPOParams` or :class:`GRPOSParams`."""
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


def _check_token_values(entropy: torch.Tensor, response_mask: torch.Tensor, neg_entropy_tol: float) -> None:
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


# --------------------------------------------------------------------------------------------------------------------
# GTPO-token


def _polarity_segments(correct: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Segment id per row: ``gid`` for correct rows, ``num_groups + gid`` for incorrect ones (``2 * NG`` segments)."""
    return gid.to(torch.long) + num_groups * (~correct.bool()).to(torch.long)


@torch.no_grad()
def active_counts(
    response_mask: torch.Tensor, correct: torch.Tensor, gid: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group, per-position survivor counts ``d_t`` (correct) and ``h_t`` (incorrect) (docs/ALGORITHMS.md §3.1).

    Args:
        response_mask: ``[B, L]`` 0/1; a response is active at ``t`` iff ``response_mask[b, t] == 1``.
        correct: ``[B]`` bool.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``.

    Returns:
        ``(d, h)``, each ``[NG, L]`` float64.
    """
    seg = _polarity_segments(correct, gid, num_groups)
    counts = segment_sum(response_mask.bool().to(torch.float64), seg, 2 * num_groups)
    return counts[:num_groups], counts[num_groups:]


def _shares_and_counts(entropy, m, correct, gid, num_groups, eps):
    """Entropy share and active count of each token's polarity at its position (``[B, L]`` float64, 0 on padding).

    One scatter-add over ``2 * NG`` segments (polarity x group) gives ``sum_{O+_t} H`` and ``sum_{O-_t} 1/(H+eps)``
    together, another the counts ``d_t`` / ``h_t``. Returns ``(share, count, counts [2NG, L] = [d; h])``.
    """
    seg = _polarity_segments(correct, gid, num_groups)
    m64 = m.to(torch.float64)
    h = torch.where(m, entropy.detach().to(torch.float64), 0.0).clamp_min_(0.0)
    # correct tokens weigh by H, incorrect ones by 1/(H + eps) (Eq. 3 / Eq. 5); padding by 0
    val = torch.where(correct[:, None], h, torch.reciprocal(h + eps)).mul_(m64)
    sums = segment_sum(val, seg, 2 * num_groups)
    counts = segment_sum(m64, seg, 2 * num_groups)
    share = val.div_(sums[seg].add_(eps))
    return share, counts[seg], counts


@torch.no_grad()
def entropy_shares(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    correct: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ε-guarded entropy shares at each position (Eq. 3 and Eq. 5 without the count factor).

    ``share+ = H / (sum_{O+_t} H + eps)`` on correct tokens; ``share- = (1/(H+eps)) / (sum_{O-_t} 1/(H+eps) + eps)`` on
    incorrect tokens. Multiplied by ``d_t`` / ``h_t`` they average to 1 over the active set (up to ε). If every
    active correct token at ``t`` has ``H = 0``, ``share+ = 0`` there (docs/ALGORITHMS.md §3.6); the negative side stays
    finite (``1/h_t`` each when all are equal).

    Args:
        entropy: ``[B, L]`` entropy (already validated; negatives clamp to 0). response_mask: ``[B, L]``.
        correct: ``[B]`` bool. gid: ``[B]``; num_groups: ``NG``. eps: the guard.

    Returns:
        ``(share_pos, share_neg)``, each ``[B, L]`` float64, zero outside their polarity and on padding.
    """
    c = correct.bool()
    share, _, _ = _shares_and_counts(entropy, response_mask.bool(), c, gid.to(torch.long), num_groups, eps)
    return torch.where(c[:, None], share, 0.0), torch.where(c[:, None], 0.0, share)


def _bases(
    rewards: torch.Tensor, correct: torch.Tensor, negative_base: str, reward_offset: torch.Tensor | None
) -> torch.Tensor:
    """Sequence base rewards ``[B]`` float64: ``r`` for correct, ``-1`` (or ``r``) for incorrect, plus the offset."""
    r = rewards.detach().to(torch.float64)
    neg_base = r if negative_base == "reward" else torch.full_like(r, -1.0)
    base = torch.where(correct, r, neg_base)
    if reward_offset is not None:
        base = base + reward_offset.detach().to(device=base.device, dtype=torch.float64)
    return base


def _gtpo_parts(entropy, m, rewards, gid, num_groups, params, reward_offset):
    """``(shaped [B, L], correct [B], base [B], counts [2NG, L] = [d; h])``, float64, shaped 0 on padding."""
    correct = rewards.detach() > params.reward_threshold
    share, cnt, counts = _shares_and_counts(entropy, m, correct, gid, num_groups, params.eps)
    base = _bases(rewards, correct, params.negative_base, reward_offset).to(share.device)
    a1, a2 = float(params.alpha1), float(params.alpha2)
    # Eq. 3: a1*r + a2*share*d_t ; Eq. 5: a1*(-1) - a2*share*h_t
    signed_a2 = (torch.where(correct, 1.0, -1.0).to(torch.float64) * a2)[:, None]
    shaped = share.mul_(cnt).mul_(signed_a2).add_((a1 * base)[:, None]).mul_(m.to(torch.float64))
    return shaped, correct, base, counts


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

    Args:
        entropy: ``[B, L]`` old-policy token entropy (detached here). response_mask: ``[B, L]`` 0/1.
        rewards: ``[B]`` sequence rewards; correct iff ``> params.reward_threshold``.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. Rows in any order, groups of any size.
        params: :class:`GTPOParams` (None: the defaults).
        reward_offset: optional ``[B]`` additive reward (GROP penalty) added to both bases.

    Returns:
        ``[B, L]`` float64; ``a1*base_i + a2*share*d_t`` on correct tokens, ``a1*base_j - a2*share*h_t`` on
        incorrect tokens, 0 on padding.
    """
    params = params or GTPOParams()
    m = response_mask.bool()
    return _gtpo_parts(entropy, m, rewards, gid.to(torch.long), num_groups, params, reward_offset)[0]


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
def gtpo_token_advantages(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GTPOParams | None = None,
    reward_offset: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GTPO-token advantages (Eq. 3, 5, 6) with diagnostics.

    Behaviour in the edge cases (docs/ALGORITHMS.md §3.6):

    - all-correct (all-wrong) group: only one polarity exists; under ``split`` (and ``joint``) its tokens get a
      non-zero entropy-rank advantage, unlike GRPO (filter such groups with DAPO dynamic sampling);
    - ``d_t = 1``: the lone active correct token gets weight 1, ``r~ = a1 r + a2``; likewise ``h_t = 1``;
    - single-response group under ``norm_scope="group"``: its shaped rewards are constant up to ε, hence advantage 0;
    - zero-length response: no token, no count, advantage 0; the rest of its group is unaffected;
    - all ``H = 0`` at ``t``: correct tokens get ``r~ = a1 r`` (conservation breaks there), incorrect ones
      ``a1*base - a2`` each; exactly uniform (incl. all-zero) entropy makes each split set constant, advantage 0;
    - padding gets 0, and padded entropy values (even NaN) are never read.

    Args:
        entropy: ``[B, L]`` old-policy token entropy (any float dtype; detached).
        response_mask: ``[B, L]`` 0/1.
        rewards: ``[B]`` sequence rewards (the verifier's; they decide correctness).
        gid: ``[B]`` int64 group ids in ``0 .. num_groups - 1``; num_groups: ``NG``.
        params: :class:`GTPOParams` (None: the defaults).
        reward_offset: optional ``[B]`` additive reward (e.g. the GROP penalty), added to both bases.
        responses: ``[B, L]`` token ids; required when ``params.conflict_mask``.

    Returns:
        ``(advantages, diagnostics)``: advantages ``[B, L]`` float32, zero on padding; diagnostics a dict of python
        floats (see :func:`_gtpo_diagnostics`).

    Raises:
        ValueError: on bad inputs (see :func:`validate_shaping_inputs`) or a missing ``responses``.
    """
    params = params or GTPOParams()
    _validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens=False)
    if params.conflict_mask:
        _check_responses(responses, response_mask)
    b, length = entropy.shape
    if b == 0 or length == 0 or num_groups == 0:
        return _gtpo_token_advantages_reference(
            entropy, response_mask, rewards, gid, num_groups, params, reward_offset, responses
        )
    from gtpo.algorithms._gtpo_fast import gtpo_fast

    return gtpo_fast(entropy, response_mask, rewards, gid, num_groups, params, reward_offset, responses)


@torch.no_grad()
def _gtpo_token_advantages_reference(
    entropy, response_mask, rewards, gid, num_groups, params=None, reward_offset=None, responses=None
):
    """Direct float64 evaluation of :func:`gtpo_token_advantages` (about 100 passes over ``[B, L]``).

    The estimator uses the chunked evaluation of :mod:`gtpo.algorithms._gtpo_fast`; this version stays as the
    readable reference (same arguments and results up to float32 rounding) and handles empty batches.
    """
    params = params or GTPOParams()
    _validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset)
    device = entropy.device
    m = response_mask.to(device).bool()
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.to(device)
    if reward_offset is not None:
        reward_offset = reward_offset.to(device)
    shaped, correct, base, counts = _gtpo_parts(entropy, m, rewards, gid, num_groups, params, reward_offset)

    scope_gid = gid if params.norm_scope == "group" else None
    kw = dict(unbiased=params.std == "unbiased", eps=float(params.eps), zero_var_rtol=float(params.zero_var_rtol))
    if params.norm_mode == "split":
        # Eq. 6: correct and incorrect tokens are separate sets; a per-(polarity, group) segment id does both at once
        if scope_gid is None:
            seg, n_seg = (~correct).to(torch.long), 2
        else:
            seg, n_seg = _polarity_segments(correct, gid, num_groups), 2 * num_groups
        adv = whiten_sets(shaped, m, seg, n_seg, **kw)
    else:
        adv = whiten_sets(shaped, m, scope_gid, num_groups, **kw)

    diag: dict[str, float] = {}
    if params.conflict_mask:
        _check_responses(responses, m)
        lam, diag["conflict_token_frac"] = _conflict_lambda(responses, m, correct, gid, num_groups, params)
        adv = adv * lam.to(device=device, dtype=torch.float64)

    adv = torch.where(m, adv, 0.0)
    diag.update(_gtpo_diagnostics(entropy, m, correct, gid, num_groups, params, shaped, adv, base, counts))
    return adv.to(torch.float32), diag


def _check_responses(responses, response_mask: torch.Tensor) -> None:
    if responses is None:
        raise ValueError("conflict_mask=True needs the response token ids (responses), got None")
    if not isinstance(responses, torch.Tensor) or tuple(responses.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"responses shape {_shape(responses)} does not match response_mask {tuple(response_mask.shape)}"
        )


def _conflict_lambda(responses, valid, correct, gid, num_groups, params) -> tuple[torch.Tensor, float]:
    """GTPO's ``conflict_mask`` option: GTPO-trajectory's conflict weights with correctness as the polarity.

    Args:
        responses: ``[B, L]`` token ids. valid: ``[B, L]`` bool mask (its device is used). correct: ``[B]`` bool.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: :class:`GTPOParams` (``conflict_lam_pos/neg``).

    Returns:
        ``(lam [B, L] float32, conflict_token_frac)``: ``lam`` multiplies the advantages (0 on padding); the
        fraction counts conflict tokens over the valid tokens. Empty responses take no part (polarity 0).
    """
    from gtpo.algorithms.trajectory import conflict_weights

    polarity = torch.where(correct, 1, -1).to(torch.int8) * valid.any(-1).to(torch.int8)
    lam, is_conflict = conflict_weights(
        responses.to(valid.device),
        valid,
        gid,
        num_groups,
        polarity,
        float(params.conflict_lam_pos),
        float(params.conflict_lam_neg),
    )
    return lam, float(is_conflict.sum()) / max(int(valid.sum()), 1)


def _masked_mean(x: torch.Tensor, sel: torch.Tensor) -> float:
    n = int(sel.sum())
    return float(torch.where(sel, x, 0.0).sum()) / n if n else 0.0


def _group_outcome_fracs(correct: torch.Tensor, nonempty: torch.Tensor, gid: torch.Tensor, num_groups: int):
    """Fractions of groups (with at least one non-empty response) that are all correct / all wrong."""
    n_rows = segment_sum(nonempty.to(torch.float64), gid, num_groups)
    n_pos = segment_sum((nonempty & correct).to(torch.float64), gid, num_groups)
    live = n_rows > 0
    n_live = int(live.sum())
    if n_live == 0:
        return 0.0, 0.0
    all_pos = float((live & (n_pos == n_rows)).sum()) / n_live
    all_neg = float((live & (n_pos == 0)).sum()) / n_live
    return all_pos, all_neg


def _gtpo_diagnostics(entropy, m, correct, gid, num_groups, params, shaped, adv, base, counts):
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
    seg = _polarity_segments(correct, gid, num_groups)
    err = (segment_sum(term, seg, 2 * num_groups) - a2 * counts).abs()
    w = term / a2 if a2 > 0 else torch.zeros_like(term)
    w_row, w2_row = w.sum(-1), (w * w).sum(-1)
    w_max = torch.where(m, w, -math.inf).amax(-1) if w.shape[-1] else torch.zeros_like(lens)
    ent_row = torch.where(m, entropy.detach(), 0.0).sum(-1).to(torch.float64)
    adv_row, abs_row = adv.sum(-1), adv.abs().sum(-1)
    pos_row, neg_row = adv.clamp(min=0).sum(-1), adv.clamp(max=0).sum(-1)
    npos_row, nneg_row = (adv > 0).sum(-1).to(torch.float64), (adv < 0).sum(-1).to(torch.float64)
    return _gtpo_diagnostics_from_rows(
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


def _gtpo_diagnostics_from_rows(
    correct, gid, num_groups, lens, *, w_row, w2_row, w_max, shaped_row, adv_row, abs_row, pos_row, neg_row,
    npos_row, nneg_row, ent_row, conservation_err,
) -> dict[str, float]:  # fmt: skip
    """The keys of :func:`_gtpo_diagnostics` from ``[B]`` per-row sums over the valid tokens.

    ``lens`` token counts; ``w_row`` / ``w2_row`` / ``w_max`` sum, sum of squares and max of the count-scaled
    entropy weights (``w_max`` is read on non-empty rows only); ``shaped_row``, ``adv_row``, ``abs_row``,
    ``pos_row``, ``neg_row`` sums of the shaped rewards, advantages, their absolute values and positive / negative
    parts; ``npos_row`` / ``nneg_row`` counts of positive / negative advantages; ``ent_row`` entropy sums.
    Both the reference and the chunked evaluation (:mod:`gtpo.algorithms._gtpo_fast`) report through this.
    """

    def _ratio(num, den):
        return float(num) / float(den) if float(den) > 0 else 0.0

    out: dict[str, float] = {}
    for name, rows in (("pos", correct), ("neg", ~correct)):
        n_tok = lens[rows].sum()
        mean = _ratio(w_row[rows].sum(), n_tok)
        var = max(_ratio(w2_row[rows].sum(), n_tok) - mean * mean, 0.0)
        live = rows & (lens > 0)
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(var)
        out[f"weight_{name}_max"] = float(w_max[live].max()) if bool(live.any()) else 0.0
    n_valid = lens.sum()
    all_pos, all_neg = _group_outcome_fracs(correct, lens > 0, gid, num_groups)
    out.update(
        {
            "shaped_correct_mean": _ratio(shaped_row[correct].sum(), lens[correct].sum()),
            "shaped_incorrect_mean": _ratio(shaped_row[~correct].sum(), lens[~correct].sum()),
            "adv_correct_mean": _ratio(adv_row[correct].sum(), lens[correct].sum()),
            "adv_incorrect_mean": _ratio(adv_row[~correct].sum(), lens[~correct].sum()),
            "adv_pos_mean": _ratio(pos_row.sum(), npos_row.sum()),
            "adv_neg_mean": _ratio(neg_row.sum(), nneg_row.sum()),
            "adv_abs_mean": _ratio(abs_row.sum(), n_valid),
            "frac_tokens_adv_pos": _ratio(npos_row.sum(), n_valid),
            "frac_tokens_adv_neg": _ratio(nneg_row.sum(), n_valid),
            "conservation_err": conservation_err,
            "frac_groups_all_correct": all_pos,
            "frac_groups_all_wrong": all_neg,
            "entropy_correct_mean": _ratio(ent_row[correct].sum(), lens[correct].sum()),
            "entropy_incorrect_mean": _ratio(ent_row[~correct].sum(), lens[~correct].sum()),
        }
    )
    return out


# --------------------------------------------------------------------------------------------------------------------
# GRPO-S


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
    base = _bases(rewards, correct, params.negative_base, reward_offset).to(hbar.device)
    b1, b2 = float(params.beta1), float(params.beta2)
    r_pos = b1 * base + b2 * hbar / (s_pos + params.eps) * n_pos
    r_neg = b1 * base - b2 * inv / (s_inv + params.eps) * n_neg
    return torch.where(p, r_pos, torch.where(n_, r_neg, zero))


@torch.no_grad()
def grpo_s_advantages(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    rewards: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    params: GRPOSParams | None = None,
    reward_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO-S advantages ``A_i = (r^_i - mean_g) / (std_g + eps)`` per group, broadcast to the response's tokens.

    Edge cases (docs/ALGORITHMS.md §4.3): an all-correct (all-wrong) group keeps a non-zero entropy-rank advantage
    unless its ``Hbar`` are all equal (then 0, as GRPO); uniform ``Hbar`` or ``beta2 = 0`` give verl GRPO's
    advantages (up to the ε in the std guard) for groups of two or more; a group with a single non-empty response
    gets 0; zero-length responses are left out of ``n``, ``m``, the sums and the group statistics, and get 0;
    ``Hbar = 0`` on the correct side gives weight 0, on the incorrect side the largest inverse weight (finite
    through ε).

    Args:
        entropy: ``[B, L]`` old-policy token entropy. response_mask: ``[B, L]`` 0/1. rewards: ``[B]``.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: :class:`GRPOSParams` (None: defaults).
        reward_offset: optional ``[B]`` additive reward (GROP).

    Returns:
        ``(advantages [B, L] float32, zero on padding; diagnostics dict of python floats)``. Diagnostics keys:
        ``seq_weight_pos_mean/max``, ``seq_weight_neg_mean/max``, ``adv_correct_mean``, ``adv_incorrect_mean``,
        ``frac_seq_adv_pos``, ``frac_seq_adv_neg``, ``conservation_err``, ``frac_groups_all_correct``,
        ``frac_groups_all_wrong``, ``seq_entropy_correct_mean``, ``seq_entropy_incorrect_mean``.
    """
    params = params or GRPOSParams()
    _validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens=False)
    from gtpo.algorithms._gtpo_fast import broadcast_rows, masked_row_sums

    device = entropy.device
    mask = response_mask.to(device)
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.to(device)
    if reward_offset is not None:
        reward_offset = reward_offset.to(device)
    # one chunked pass over [B, L]: token checks, masked entropy sums and lengths (= sequence_entropy)
    hsum, lens = masked_row_sums(entropy, mask, params.neg_entropy_tol)
    nonempty = lens > 0
    correct = rewards.detach() > params.reward_threshold
    hbar = hsum / lens.clamp(min=1)
    shaped = grpo_s_sequence_rewards(hbar, rewards, gid, num_groups, params, nonempty, reward_offset)

    mean, std, count = group_mean_std(shaped, gid, num_groups, unbiased=params.std == "unbiased", valid=nonempty)
    abs_mean = segment_sum(torch.where(nonempty, shaped.abs(), 0.0), gid, num_groups) / count.clamp(min=1)
    constant = (count <= 1) | (std <= params.zero_var_rtol * abs_mean)
    adv_seq = (shaped - mean[gid]) / (std[gid] + params.eps)
    adv_seq = torch.where(nonempty & ~constant[gid], adv_seq, 0.0)
    adv = broadcast_rows(adv_seq, mask)

    # diagnostics
    p, n_ = nonempty & correct, nonempty & ~correct
    zero = torch.zeros((), dtype=torch.float64, device=device)
    n_pos = segment_sum(p.to(torch.float64), gid, num_groups)
    n_neg = segment_sum(n_.to(torch.float64), gid, num_groups)
    b1, b2 = float(params.beta1), float(params.beta2)
    base = _bases(rewards, correct, params.negative_base, reward_offset).to(device)
    w_pos = (shaped - b1 * base) / b2 if b2 > 0 else torch.zeros_like(shaped)
    w_neg = (b1 * base - shaped) / b2 if b2 > 0 else torch.zeros_like(shaped)
    err_pos = segment_sum(torch.where(p, shaped - b1 * base, zero), gid, num_groups) - b2 * n_pos
    err_neg = segment_sum(torch.where(n_, shaped - b1 * base, zero), gid, num_groups) + b2 * n_neg
    all_pos, all_neg = _group_outcome_fracs(correct, nonempty, gid, num_groups)
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
        "frac_groups_all_correct": all_pos,
        "frac_groups_all_wrong": all_neg,
        "seq_entropy_correct_mean": _masked_mean(hbar, p),
        "seq_entropy_incorrect_mean": _masked_mean(hbar, n_),
    }
    return adv.to(torch.float32), diag
