"""GTPO-token: per-token rewards shaped by the old policy's entropy (Tan et al., arXiv 2508.04349, "paper A").

Specification: docs/ALGORITHMS.md §0, §3. Knobs: ``algorithm.gtpo`` (:class:`GTPOParams`). This file holds the knobs,
the definition (:func:`gtpo_token_definition`, float64 torch, every formula as written) and the entry point
(:func:`gtpo_token_advantages`), which hands CPU tensors to the compiled kernel (:mod:`gtpo.algorithms.kernels`,
tested against the definition) and evaluates the definition elsewhere.

Eq. 3 (correct responses) and Eq. 5 (incorrect ones), with the eps guards of Remark 2.1::

    r~+_{i,t} = a1 * base_i + a2 * H_{i,t} / (sum_{k in O+_t} H_{k,t} + eps) * d_t
    r~-_{j,t} = a1 * base_j - a2 * (1/(H_{j,t}+eps)) / (sum_{k in O-_t} 1/(H_{k,t}+eps) + eps) * h_t

``d_t`` / ``h_t`` count the correct / incorrect responses active at position ``t`` (``response_mask[:, t] == 1``;
positions are offsets from the response start; with tool tokens inside a response the entry point first moves the
model's tokens to the columns of ``position``, docs/ALGORITHMS.md §13); ``weight_scope`` says over which responses
the sums and counts run: ``batch`` (paper §4, "compares entropy across different problems") or ``group`` (as
typeset). ``base`` is the reward of a correct response and the literal -1 of Eq. 5 for an incorrect one
(``negative_base``), plus GROP's penalty where the method applies it (``reward_offset``, App. D). Eq. 6:
``A~ = (r~ - mean) / (std + eps)`` over each token's whitening set: ``zero_fill`` (§2.2) whitens the r~+ field (0 on
incorrect tokens) and the r~- field (0 on correct ones) over all valid tokens of the scope, a correct token taking
A~+, an incorrect one A~-; ``joint`` whitens the signed r~ over the scope; ``split`` each polarity's own tokens
(loses the sign of correctness, §3.7).

Deliberate choices where the paper is silent (each a knob or stated behaviour):

- ``std="unbiased"`` (verl's ``masked_whiten``); eps = 1e-6 in ``1/(H+eps)``, ``sum + eps`` and ``std + eps``.
- A whitening set whose std is ``<= zero_var_rtol * mean|x|`` (or with fewer than two tokens) is constant: advantage
  0 (the eps guards alone make "equal" rewards differ by ``~a2 * eps / H``; whitening would make unit advantages of
  rounding).
- Entropies in ``[-neg_entropy_tol, 0)`` (bf16 rounding of a near-deterministic token) count as 0; lower raise.
- Zero-length responses take no part (no count, no set) and get 0; padding gets 0 and is never read.
- The entropy never carries gradient (Remark 2.5): everything runs under ``torch.no_grad()``.
- ``conflict_mask`` (an extension): the advantages are multiplied by GTPO-trajectory's conflict-token weights
  (arXiv 2508.03772 §6.2; :mod:`gtpo.algorithms.conflict_tokens`), correctness as the polarity.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from gtpo.algorithms.conflict_tokens import conflict_weights
from gtpo.algorithms.gaps import MaskGaps
from gtpo.algorithms.kernel_dispatch import kernel_guard, kernel_on
from gtpo.algorithms.token_positions import POSITIONS, position_layout
from gtpo.knobs import check_choice, check_flag, check_real

__all__ = [
    "GTPOParams",
    "check_inputs",
    "check_responses",
    "check_token_values",
    "gtpo_shaped_rewards",
    "gtpo_token_advantages",
    "gtpo_token_definition",
    "reward_bases",
]

NORM_MODES = ("zero_fill", "joint", "split")
SCOPES = ("batch", "group")
STD_CHOICES = ("unbiased", "population")
NEGATIVE_BASES = ("minus_one", "reward")


@dataclass(frozen=True)
class GTPOParams:
    """``algorithm.gtpo``; the defaults are the paper's (docs/ALGORITHMS.md §3.5, §11).

    Attributes:
        alpha1: weight of the sequence reward (paper 1.0).
        alpha2: weight of the entropy term (paper 0.1).
        eps: entropy guard in ``1/(H+eps)`` and ``sum + eps`` (Remark 2.1) and in the whitening denominator.
        reward_threshold: a response is correct iff its sequence reward is ``> reward_threshold``.
        norm_mode: Eq. 6's sets: ``zero_fill`` (paper §2.2), ``joint`` or ``split`` (see the module docstring).
        norm_scope: ``batch`` (paper §2.2: "all tokens in the entire batch") or ``group`` (per prompt group).
        weight_scope: where Eq. 3 / Eq. 5's sums and counts are taken: ``batch`` (paper §4) or ``group``.
        std: ``unbiased`` (Bessel-corrected) or ``population`` std in the whitening.
        negative_base: ``minus_one`` (the literal -1 of Eq. 5) or ``reward`` (the incorrect response's own reward).
        zero_var_rtol: a whitening set with ``std <= zero_var_rtol * mean|x|`` is constant (advantage 0).
        neg_entropy_tol: entropies in ``[-neg_entropy_tol, 0)`` are rounding and count as 0; lower values raise.
        conflict_mask: multiply the advantages by GTPO-trajectory's conflict weights (needs ``responses``).
        conflict_lam_pos: conflict-token weight of correct responses (paper B: 2).
        conflict_lam_neg: conflict-token weight of incorrect responses (paper B: 0).
        position: what "position t" of Eq. 3 / Eq. 5 is when tool tokens sit inside a response (multi-turn tool
            use, docs/ALGORITHMS.md §13): ``model`` (the index among the model's own tokens), ``raw`` (the column in
            the response) or ``turn`` (assistant turn and index within it); all three read single-turn responses
            alike (:mod:`gtpo.algorithms.token_positions`).
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
    position: str = "model"

    def __post_init__(self) -> None:
        check_real("alpha1", self.alpha1, lo=0.0)
        check_real("alpha2", self.alpha2, lo=0.0)
        if float(self.alpha1) + float(self.alpha2) <= 0.0:
            raise ValueError(f"alpha1={self.alpha1!r}: alpha1 + alpha2 must be > 0, else every advantage is 0")
        check_real("eps", self.eps, lo=0.0, lo_open=True, hi=1e-2)
        check_real("reward_threshold", self.reward_threshold)
        check_choice("norm_mode", self.norm_mode, NORM_MODES)
        check_choice("norm_scope", self.norm_scope, SCOPES)
        check_choice("weight_scope", self.weight_scope, SCOPES)
        check_choice("std", self.std, STD_CHOICES)
        check_choice("negative_base", self.negative_base, NEGATIVE_BASES)
        check_real("zero_var_rtol", self.zero_var_rtol, lo=0.0, hi=1.0)
        check_real("neg_entropy_tol", self.neg_entropy_tol, lo=0.0)
        check_flag("conflict_mask", self.conflict_mask)
        check_real("conflict_lam_pos", self.conflict_lam_pos, lo=0.0)
        check_real("conflict_lam_neg", self.conflict_lam_neg, lo=0.0)
        check_choice("position", self.position, POSITIONS)
        if self.position == "turn" and self.conflict_mask:
            # a conflict run is a completion's leading or trailing run (paper B), not one per turn
            raise ValueError(
                "position='turn': conflict_mask=true needs position=model or raw (conflict runs are a whole "
                "response's leading and trailing runs)"
            )

    @property
    def needs(self) -> tuple[str, ...]:
        """What these knobs need from the batch beyond the entropy: the token ids under ``conflict_mask``."""
        return ("responses",) if self.conflict_mask else ()


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
    **_: object,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GTPO-token advantages (Eq. 3, 5, 6) and diagnostics.

    The recipe's estimator contract (every row's ``advantages``, called by keyword by :mod:`gtpo.verl_plugin`):
    ``entropy``, ``response_mask``, ``rewards``, ``gid``, ``num_groups``, ``params``, ``reward_offset``,
    ``responses``, ``state``, ``global_steps``; an estimator takes what it reads and ignores the rest.

    Args:
        entropy: ``[B, L]`` old-policy token entropy (any float dtype; padding may hold anything, NaN included).
        response_mask: ``[B, L]`` 0/1 (bool, int or float); may hold zeros inside a response (tool tokens: their
            entropy is never read and their advantage is 0; ``params.position`` says where the other tokens sit).
        rewards: ``[B]`` sequence rewards (the verifier's; they decide correctness).
        gid: ``[B]`` int64 group ids in ``0 .. num_groups - 1``; rows in any order, groups of any size.
        num_groups: ``NG``.
        params: :class:`GTPOParams` (None: the defaults).
        reward_offset: optional ``[B]`` additive reward (GROP's penalty), added to both bases.
        responses: ``[B, L]`` token ids; required under ``params.conflict_mask``.

    Returns:
        ``(advantages [B, L] float32, zero on padding; diagnostics)``, the diagnostics python floats:
        ``weight_{pos,neg}_{mean,std,max}`` (the count-scaled entropy weights ``share * d_t``, mean 1 by construction;
        0 when ``alpha2 = 0``), ``shaped_correct_mean`` / ``shaped_incorrect_mean`` (token means of r~),
        ``adv_correct_mean`` / ``adv_incorrect_mean``, ``adv_pos_mean`` / ``adv_neg_mean`` (mean of the positive /
        negative advantages), ``adv_abs_mean``, ``frac_tokens_adv_pos`` / ``frac_tokens_adv_neg``, ``conservation_err``
        (max over weight segments and positions of ``|sum r~ - (a1 sum base +- a2 count)|``; ~``a2 * eps / H`` unless
        all entropies at a position are 0), ``frac_groups_all_correct`` / ``frac_groups_all_wrong``,
        ``entropy_correct_mean`` / ``entropy_incorrect_mean``; ``conflict_token_frac`` under ``conflict_mask``;
        ``kernel_compile_s`` on the call that compiled the kernel.
    """
    params = params or GTPOParams()
    check_inputs(entropy, response_mask, rewards, gid, num_groups, reward_offset, params)
    if params.conflict_mask:
        check_responses(responses, response_mask)
    correct = rewards.detach() > params.reward_threshold
    base = reward_bases(rewards, correct, params.negative_base, reward_offset)
    gaps = None  # unknown; the kernel's first pass finds them at no extra cost
    if _on_cpu(entropy, response_mask, responses) and kernel_on("gtpo_token"):
        with kernel_guard("gtpo_token"):  # numba missing or failing: the definition below
            from gtpo.algorithms import kernels

            try:
                return kernels.gtpo_token_kernel(
                    entropy, response_mask, correct.cpu(), base.cpu(), gid.cpu(), num_groups, params, responses
                )
            except kernels.BadValues:  # the check below names the problem
                pass
            except MaskGaps:  # tool tokens inside the responses
                gaps = True
    layout = position_layout(response_mask, params.position, gaps)
    if layout is not None:  # tool tokens inside the responses: run where each column is one position, then back
        advantages, diagnostics = gtpo_token_advantages(
            layout.gather(entropy), layout.gather(response_mask), rewards, gid, num_groups,
            dataclasses.replace(params, position="raw"), reward_offset,
            None if responses is None else layout.gather(responses),
        )  # fmt: skip
        return layout.scatter(advantages), diagnostics
    check_token_values(entropy, response_mask.to(entropy.device), params.neg_entropy_tol)
    return gtpo_token_definition(entropy, response_mask, rewards, gid, num_groups, params, reward_offset, responses)


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
    counts = _segment_sum(response_mask.bool().to(_F64), seg, 2 * num_groups)
    return counts[:num_groups], counts[num_groups:]


def _shares_and_counts(entropy, m, correct, gid, num_groups, eps, weight_scope):
    """Entropy share and active count of each token's polarity at its position (``[B, L]`` float64, 0 on padding)."""
    seg, n_seg = weight_segments(correct, gid, num_groups, weight_scope)
    m64 = m.to(_F64)
    h = torch.where(m, entropy.detach().to(_F64), 0.0).clamp_min_(0.0)
    # correct tokens weigh by H, incorrect ones by 1/(H + eps) (Eq. 3 / Eq. 5); padding by 0
    val = torch.where(correct[:, None], h, torch.reciprocal(h + eps)).mul_(m64)
    sums = _segment_sum(val, seg, n_seg)
    counts = _segment_sum(m64, seg, n_seg)
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
    abs_mean = _segment_sum(torch.where(sel, xd.abs(), 0.0).sum(-1), gid, num_groups) / count.clamp(min=1)
    constant = (count <= 1) | (std <= zero_var_rtol * abs_mean)
    out = (xd - mean[gid][:, None]) / (std[gid][:, None] + eps)
    return torch.where(sel & ~constant[gid][:, None], out, 0.0)


@torch.no_grad()
def gtpo_token_definition(
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
        :func:`gtpo_token_advantages`.
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
    err = (_segment_sum(term, seg, n_seg) - a2 * _segment_sum(m64, seg, n_seg)).abs()
    w = term / a2 if a2 > 0 else torch.zeros_like(term)
    out: dict[str, float] = {}
    for name, sel, count in (("pos", pos, n_pos), ("neg", neg, n_neg)):
        mean = _ratio(w[sel].sum(), count)
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(max(_ratio((w[sel] ** 2).sum(), count) - mean * mean, 0.0))
        out[f"weight_{name}_max"] = float(w[sel].max()) if bool(sel.any()) else 0.0
    h = torch.where(m, entropy.detach().to(_F64), 0.0)
    nonempty = m.any(-1)
    rows_per_group = _segment_sum(nonempty.to(_F64), gid, num_groups)
    correct_per_group = _segment_sum((nonempty & correct).to(_F64), gid, num_groups)
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


def reward_bases(
    rewards: torch.Tensor, correct: torch.Tensor, negative_base: str, reward_offset: torch.Tensor | None
) -> torch.Tensor:
    """``[B]`` float64 ``base``: ``r`` for correct, ``-1`` (or ``r``) for incorrect responses, plus the offset.

    It multiplies ``a1`` (``b1``) in Eq. 3 / Eq. 5 (Eq. 9 of GRPO-S).
    """
    r = rewards.detach().to(_F64)
    neg_base = r if negative_base == "reward" else torch.full_like(r, -1.0)
    base = torch.where(correct, r, neg_base)
    if reward_offset is not None:
        base = base + reward_offset.detach().to(device=base.device, dtype=_F64)
    return base


def check_inputs(entropy, response_mask, rewards, gid, num_groups, reward_offset, params) -> None:
    """Raise ``ValueError`` naming the problem of inputs that cannot be shaped (GTPO-token and GRPO-S)."""
    if not isinstance(entropy, torch.Tensor) or entropy.dim() != 2:
        raise ValueError(f"entropy must be a [batch, response_len] tensor, got {_shape(entropy)}")
    if not entropy.is_floating_point():
        raise ValueError(f"entropy must be floating point, got dtype {entropy.dtype}")
    if not isinstance(response_mask, torch.Tensor) or tuple(response_mask.shape) != tuple(entropy.shape):
        raise ValueError(f"response_mask shape {_shape(response_mask)} does not match entropy {tuple(entropy.shape)}")
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
    r = rewards.detach().to(_F64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards must be finite, got {int((~torch.isfinite(r)).sum())} NaN/inf sequence reward(s)")
    correct = r > params.reward_threshold
    if bool((correct & (r <= 0)).any()):
        raise ValueError(
            f"reward {float(r[correct & (r <= 0)][0]):g} is above reward_threshold={params.reward_threshold:g} "
            "(correct) but not > 0; the correct-side base is the reward itself, so correct rewards must be positive "
            "(raise reward_threshold)"
        )
    if params.negative_base == "reward" and bool((~correct & (r >= 0)).any()):
        raise ValueError(
            f"reward {float(r[~correct & (r >= 0)][0]):g} is incorrect (<= reward_threshold="
            f"{params.reward_threshold:g}) but not < 0; negative_base='reward' needs negative rewards for incorrect "
            "responses (use 'minus_one' for 0/1 rewards)"
        )
    if reward_offset is not None:
        if not isinstance(reward_offset, torch.Tensor) or tuple(reward_offset.shape) != (b,):
            raise ValueError(f"reward_offset must have shape [{b}], got {_shape(reward_offset)}")
        if not bool(torch.isfinite(reward_offset.detach()).all()):
            raise ValueError("reward_offset must be finite")


def check_responses(responses, response_mask: torch.Tensor) -> None:
    """Integer token ids of the mask's shape (conflict tokens compare them)."""
    if not isinstance(responses, torch.Tensor) or tuple(responses.shape) != tuple(response_mask.shape):
        raise ValueError(
            f"responses (the token ids) must match response_mask {tuple(response_mask.shape)}, got {_shape(responses)}"
        )
    if responses.dtype.is_floating_point or responses.dtype == torch.bool:
        raise ValueError(f"responses must hold integer token ids, got dtype {responses.dtype}")


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _segment_sum(x: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``out[g] = sum_{b: segment[b] == g} x[b]``: ``[B, ...]`` -> ``[num_segments, ...]``."""
    return torch.zeros((num_segments, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, segment, x)


def masked_group_mean_std(
    x: torch.Tensor, select: torch.Tensor, gid: torch.Tensor | None, num_groups: int, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean and std over the selected tokens of each group (or of the whole batch when ``gid`` is None).

    Two passes (mean, then centred squares) in float64, so the result does not suffer from cancellation.

    Args:
        x: ``[B, L]`` values.
        select: ``[B, L]`` bool, the tokens that enter the statistics.
        gid: ``[B]`` int64 group ids, or None for one batch-wide set.
        num_groups: ``NG`` (ignored when ``gid`` is None).
        unbiased: Bessel-corrected variance.

    Returns:
        ``(mean, std, count)`` of shape ``[NG]`` (or ``[1]`` batch-wide); index them with ``gid`` to broadcast.
        ``count`` is the number of selected tokens; std is 0 where ``count <= 1``.
    """
    sel = select.to(torch.float64)
    xd = x.to(torch.float64) * sel
    if gid is None:
        gid = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        num_groups = 1
    count = _segment_sum(sel.sum(-1), gid, num_groups)
    mean = _segment_sum(xd.sum(-1), gid, num_groups) / count.clamp(min=1)
    centred = (x.to(torch.float64) - mean[gid][:, None]) * sel
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    std = (_segment_sum((centred * centred).sum(-1), gid, num_groups) / denom).sqrt()
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return mean, std, count.to(torch.long)


def check_token_values(entropy: torch.Tensor, response_mask: torch.Tensor, neg_entropy_tol: float = math.inf) -> None:
    """Raise naming the problem of ``[B, L]`` values an estimator cannot read: a mask value other than 0 and 1, a NaN
    or inf entropy on a valid token, or one below ``-neg_entropy_tol`` (entropy is >= 0: log-probs passed instead?).
    Padding may hold anything."""
    if response_mask.dtype != torch.bool and bool(((response_mask != 0) & (response_mask != 1)).any()):
        raise ValueError("response_mask must hold only 0 and 1")
    valid = response_mask.bool()
    if not (valid.shape[-1] and bool(valid.any())):
        return
    h = entropy.detach()
    for name, bad in (("NaN", torch.isnan(h)), ("inf", torch.isinf(h))):
        count = int((bad & valid).sum())
        if count:
            raise ValueError(f"entropy holds {name} on {count} valid token(s)")
    lowest = float(torch.where(valid, h, math.inf).min())
    if lowest < -neg_entropy_tol:
        raise ValueError(
            f"entropy holds negative value {lowest:.6g} on a valid token (below -neg_entropy_tol="
            f"{-neg_entropy_tol:g}); entropy is >= 0, were log-probs passed instead?"
        )
