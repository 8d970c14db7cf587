"""GTPO-token's and GRPO-S's knobs (Tan et al., arXiv 2508.04349): what the paper settles, what it leaves open.

Paper: Tan et al., "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy",
arXiv 2508.04349 (docs/ALGORITHMS.md §0, §3, §4). :class:`GTPOParams` (``algorithm.gtpo``) and :class:`GRPOSParams`
(``algorithm.grpo_s``) check their values on construction; the estimators that read them are
:mod:`gtpo.algorithms.entropy_shaping`, the inputs' checks and bases :mod:`gtpo.algorithms.shaping_inputs`.

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

__all__ = ["GTPOParams", "GRPOSParams", "GTPO_NORM_MODES", "GRPO_S_NORM_MODES"]

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
