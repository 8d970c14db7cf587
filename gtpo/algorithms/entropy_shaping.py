"""GTPO-token and GRPO-S (Tan et al., arXiv 2508.04349, "paper A"): knobs, input checks, bases and the estimators.

Paper: Tan et al., "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy",
arXiv 2508.04349 (docs/ALGORITHMS.md §0, §3, §4). Each estimator is one function here
(:func:`gtpo_token_advantages`, :func:`grpo_s_advantages`) that validates its inputs once and hands them to

- its compiled CPU kernel, :mod:`gtpo.algorithms.gtpo_token_kernel` / :mod:`gtpo.algorithms.grpo_s_kernel` (numba;
  the path of every CPU batch, i.e. of verl's driver), or
- its definition, :mod:`gtpo.algorithms.gtpo_token` / :mod:`gtpo.algorithms.grpo_s` (float64 torch with the paper's
  equation numbers; the kernels' test oracle), for tensors on another device, or when numba is missing or a kernel
  fails to compile (:mod:`gtpo.algorithms.kernel_support` warns once).

GROP, the length penalty that feeds the bases, is :mod:`gtpo.algorithms.length_penalty` (App. D).

What the paper settles (its own section numbers) and what this recipe does by default:

- Eq. 6 (§2.2): separate advantages for the positive and negative sets, "both normalized over all tokens in the
  entire batch"; Eq. 3 / Eq. 5 give every token both shaped rewards, one of them the explicit 0.
  ``norm_mode="zero_fill"`` (default) whitens the r~+ field and the r~- field over all valid tokens of the scope
  (zeros included); a correct token takes A~+, an incorrect one A~-. ``joint`` (one set of signed rewards) and
  ``split`` (statistics over each polarity's own tokens, the reading of every public re-implementation; loses the
  sign of correctness, docs/ALGORITHMS.md §3.7) stay as switches. ``norm_scope="batch"`` by default (§2.2).
- §4: "Our current implementation operates at the batch level, which compares entropy across different problems":
  ``weight_scope="batch"`` (default) takes the sums over k of H_{k,t} and 1/H_{k,t} and the counts d_t, h_t over the
  correct (incorrect) responses of the whole batch active at t; ``"group"`` is the equations as typeset.
- §2.3: GRPO-S advantages are "computed analogously to Eq. (1) ... normalizing over the G sequences in the group",
  with r^-_i = r^+_j = 0 (Eq. 9): ``algorithm.grpo_s.norm_mode="zero_fill"`` (default); ``joint`` stays.

Deliberate choices where the paper is silent (each one a knob or documented behaviour):

- ``std="unbiased"`` by default (verl's ``masked_whiten`` and ``torch.std``): it makes GRPO-S reduce exactly to
  verl's GRPO at beta2 = 0 (A2-T2). Over thousands of tokens the two conventions agree to 1e-4; ``"population"``
  (textpolicy) is available.
- Epsilon (Remark 2.1 gives none): ``1/(H+eps)``, ``sum + eps`` and ``(std + eps)``, eps = 1e-6.
- Zero-variance tolerance: a whitening set whose std is ``<= zero_var_rtol * mean(|x|)`` (or that holds fewer than two
  values) gets advantage 0 (docs/ALGORITHMS.md §3.6 last bullet): the eps guards alone make "equal" shaped rewards
  differ by ~ ``a2 * eps / H``, and dividing such a spread by its own std would turn rounding into unit advantages.
- Negative base: ``negative_base="minus_one"`` (default) uses the literal -1 of Eq. 5 for every incorrect response,
  whatever its reward (0/1 and +-1 verifiers alike); ``"reward"`` uses the incorrect response's own (negative) reward,
  so a length penalty that a +-1 reward function folded into the reward reaches it. Penalties passed separately as
  ``reward_offset`` (GROP) are added to the base on both sides under either choice, then scaled by ``a1``.
- Negative entropies within ``neg_entropy_tol`` of 0 (low-precision rounding of a near-deterministic token) are
  clamped to 0; anything more negative raises (it usually means log-probs were passed instead of entropies).
- Zero-length responses (no valid token) take no part: they count in no ``d_t`` / ``h_t``, no ``n`` / ``m`` and no
  normalisation set, and get advantage 0.
- GRPO-S groups with one (non-empty) response get advantage 0; verl's GRPO instead returns the raw reward for them.
- The entropy is the old policy's (Eq. 4) and never carries gradient (Remark 2.5): every function runs under
  ``torch.no_grad()`` and detaches its inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from gtpo.algorithms.kernel_support import kernel_failed, load_kernel

__all__ = [
    "GTPOParams",
    "GRPOSParams",
    "GTPO_NORM_MODES",
    "GRPO_S_NORM_MODES",
    "gtpo_token_advantages",
    "grpo_s_advantages",
    "validate_shaping_inputs",
    "validate_with_params",
    "check_token_values",
    "check_responses",
    "shaping_bases",
]

GTPO_NORM_MODES = ("zero_fill", "joint", "split")
GRPO_S_NORM_MODES = ("zero_fill", "joint")
_SCOPES = ("batch", "group")

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
        norm_mode: Eq. 6 statistics. ``"zero_fill"`` (paper §2.2): the r~+ field (0 on incorrect tokens) and the
            r~- field (0 on correct tokens) are whitened over all valid tokens of the scope; a correct token takes
            A~+, an incorrect one A~-. ``"joint"``: one set of the signed shaped rewards. ``"split"``: each
            polarity over its own tokens only (loses the sign of correctness; an ablation).
        norm_scope: ``"batch"`` (paper §2.2: "all tokens in the entire batch") or ``"group"`` (per prompt group).
        weight_scope: where the entropy shares and counts of Eq. 3 / Eq. 5 (sum_k H_{k,t}, sum_k 1/H_{k,t}, d_t,
            h_t) are taken: ``"batch"`` (paper §4: entropy compared across problems) or ``"group"`` (as typeset).
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
    norm_mode: str = "zero_fill"
    norm_scope: str = "batch"
    weight_scope: str = "batch"
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
        _check_choice("norm_mode", self.norm_mode, GTPO_NORM_MODES)
        _check_choice("norm_scope", self.norm_scope, _SCOPES)
        _check_choice("weight_scope", self.weight_scope, _SCOPES)
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
        norm_mode: ``"zero_fill"`` (paper §2.3, Eq. 9: r^- = 0 on correct and r^+ = 0 on incorrect responses; each
            field whitened over the G responses of the group, a correct response takes A^+, an incorrect one A^-)
            or ``"joint"`` (one set of the signed shaped rewards per group).
        std: ``"unbiased"`` (verl GRPO's ``torch.std``) or ``"population"`` group std.
        negative_base: ``"minus_one"`` or ``"reward"``, as in :class:`GTPOParams`.
        zero_var_rtol: a group field with ``std <= zero_var_rtol * mean|r_hat|`` gets advantage 0.
        neg_entropy_tol: entropies in ``[-neg_entropy_tol, 0)`` clamp to 0; lower values raise.
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
        _check_real("beta1", self.beta1, lo=0.0)
        _check_real("beta2", self.beta2, lo=0.0)
        if float(self.beta1) + float(self.beta2) <= 0.0:
            raise ValueError(f"beta1={self.beta1!r}: beta1 + beta2 must be > 0, else every advantage is 0")
        _check_real("eps", self.eps, lo=0.0, lo_open=True, hi=1e-2)
        _check_real("reward_threshold", self.reward_threshold)
        _check_choice("norm_mode", self.norm_mode, GRPO_S_NORM_MODES)
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


def _on_cpu(*tensors) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


# --------------------------------------------------------------------------------------------------------------------
# the estimators


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

    Behaviour in the edge cases (docs/ALGORITHMS.md §3.3, §3.6):

    - ``zero_fill``: correct tokens sit above mean(R~+) and incorrect ones below mean(R~-), so the sign of
      correctness survives; at ``alpha2 = 0`` (or uniform entropy) correct tokens get ``sqrt((1-p)/p)`` and
      incorrect ones ``-sqrt(p/(1-p))``, p the share of correct tokens in the scope (= ``joint``);
    - a scope with one polarity only: the other field is all zeros; its own field's std is the entropy spread
      alone (an entropy-rank signal, as ``split`` and ``joint``);
    - ``d_t = 1``: the lone active correct token gets weight 1, ``r~ = a1 r + a2``; likewise ``h_t = 1``;
    - single-response group under ``norm_scope="group"`` and ``split``/``joint``: constant up to ε, advantage 0;
    - zero-length response: no token, no count, advantage 0; the rest of its group is unaffected;
    - all ``H = 0`` at ``t``: correct tokens get ``r~ = a1 r`` (conservation breaks there), incorrect ones
      ``a1*base - a2`` each;
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
        ``(advantages [B, L] float32, zero on padding; diagnostics)``, the diagnostics a dict of python floats:
        ``weight_pos_mean/std/max`` and ``weight_neg_*`` (the count-scaled entropy weights ``share*d_t``, mean 1 by
        construction; 0 when ``alpha2 = 0``), ``shaped_correct_mean`` / ``shaped_incorrect_mean`` (token means of the
        shaped reward), ``adv_correct_mean`` / ``adv_incorrect_mean``, ``adv_pos_mean`` / ``adv_neg_mean`` (mean of the
        positive / negative advantages), ``adv_abs_mean``, ``frac_tokens_adv_pos`` / ``frac_tokens_adv_neg`` (a zero
        advantage is neither), ``conservation_err`` (max over weight segments and positions of ``|sum r~ - (a1*sum base
        +- a2*count)|``; ~``a2*eps/H`` unless all entropies at a position are 0), ``frac_groups_all_correct`` /
        ``frac_groups_all_wrong``, ``entropy_correct_mean`` / ``entropy_incorrect_mean``; ``conflict_token_frac`` under
        ``conflict_mask``; ``kernel_compile_s`` on the call that compiled the kernel.

    Raises:
        ValueError: on bad inputs (:func:`validate_shaping_inputs`) or a missing ``responses``.
    """
    params = params or GTPOParams()
    validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens=False)
    if params.conflict_mask:
        check_responses(responses, response_mask)
    correct = rewards.detach() > params.reward_threshold
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset)
    kernel = load_kernel("gtpo_token_kernel") if _on_cpu(entropy, response_mask, responses) else None
    if kernel is not None:
        try:
            return kernel.gtpo_token_kernel(
                entropy, response_mask, correct.cpu(), base.cpu(), gid.cpu(), num_groups, params, responses
            )
        except kernel.CompileError as err:
            kernel_failed("gtpo_token_kernel", err)
    from gtpo.algorithms.gtpo_token import gtpo_token_reference

    check_token_values(entropy, response_mask.to(entropy.device), params.neg_entropy_tol)
    return gtpo_token_reference(entropy, response_mask, rewards, gid, num_groups, params, reward_offset, responses)


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
    """GRPO-S advantages per group (§2.3, Eq. 8, 9), broadcast to the response's tokens.

    ``norm_mode="zero_fill"``: ``A^+_i = (r^+_i - mean_G(r^+)) / (std_G(r^+) + eps)`` with r^+ = 0 on the group's
    incorrect responses (Eq. 9), ``A^-_j`` likewise; a correct response takes A^+, an incorrect one A^-.
    ``"joint"``: ``A_i = (r^_i - mean_G(r^)) / (std_G(r^) + eps)`` over the signed shaped rewards.

    Edge cases (docs/ALGORITHMS.md §4.3): an all-correct (all-wrong) group keeps a non-zero entropy-rank advantage
    unless its ``Hbar`` are all equal (then 0, as GRPO); uniform ``Hbar`` or ``beta2 = 0`` give verl GRPO's
    advantages (up to the ε in the std guard) for groups of two or more; a group with a single non-empty response
    gets 0; zero-length responses are left out of ``n``, ``m``, the sums and the group statistics, and get 0;
    ``Hbar = 0`` on the correct side gives weight 0, on the incorrect side the largest inverse weight (finite
    through ε); entropies in ``[-neg_entropy_tol, 0)`` count as 0 in ``Hbar``.

    Args:
        entropy: ``[B, L]`` old-policy token entropy. response_mask: ``[B, L]`` 0/1. rewards: ``[B]``.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: :class:`GRPOSParams` (None: defaults).
        reward_offset: optional ``[B]`` additive reward (GROP).

    Returns:
        ``(advantages [B, L] float32, zero on padding; diagnostics dict of python floats)``. Diagnostics
        keys: ``seq_weight_pos_mean/max``, ``seq_weight_neg_mean/max``, ``adv_correct_mean``,
        ``adv_incorrect_mean``, ``adv_abs_mean``, ``frac_seq_adv_pos``, ``frac_seq_adv_neg``, ``conservation_err``,
        ``frac_groups_all_correct``, ``frac_groups_all_wrong``, ``seq_entropy_correct_mean``,
        ``seq_entropy_incorrect_mean``; ``kernel_compile_s`` on the call that compiled the kernel.
    """
    params = params or GRPOSParams()
    validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens=False)
    correct = rewards.detach() > params.reward_threshold
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset)
    kernel = load_kernel("grpo_s_kernel") if _on_cpu(entropy, response_mask) else None
    if kernel is not None:
        try:
            return kernel.grpo_s_kernel(
                entropy, response_mask, correct.cpu(), base.cpu(), gid.cpu(), num_groups, params
            )
        except kernel.CompileError as err:
            kernel_failed("grpo_s_kernel", err)
    from gtpo.algorithms.grpo_s import grpo_s_reference

    check_token_values(entropy, response_mask.to(entropy.device), params.neg_entropy_tol)
    return grpo_s_reference(entropy, response_mask, rewards, gid, num_groups, params, reward_offset)
