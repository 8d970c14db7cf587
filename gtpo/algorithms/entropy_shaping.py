"""GTPO-token and GRPO-S (Tan et al., arXiv 2508.04349, "paper A"): the estimators, each a definition or a kernel.

Paper: Tan et al., "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy",
arXiv 2508.04349 (docs/ALGORITHMS.md §0, §3, §4). Each estimator is one function here
(:func:`gtpo_token_advantages`: Eq. 3, 5, 6; :func:`grpo_s_advantages`: Eq. 8, 9, §2.3) that validates its inputs
once (:mod:`gtpo.algorithms.shaping_inputs`) and hands them to

- its compiled CPU kernel, :mod:`gtpo.algorithms.gtpo_token_kernel` / :mod:`gtpo.algorithms.grpo_s_kernel` (numba;
  the path of every CPU batch, i.e. of verl's driver), or
- its definition, :mod:`gtpo.algorithms.gtpo_token` / :mod:`gtpo.algorithms.grpo_s` (float64 torch with the paper's
  equation numbers; the kernels' test oracle), for tensors on another device, or when numba is missing or a kernel
  fails to compile (:func:`gtpo.algorithms.kernel_dispatch.kernel_guard` warns once).

The knobs, what the paper settles and every deliberate deviation where it is silent (std convention, eps,
zero-variance rule, negative base, negative-entropy tolerance, empty responses, single-response groups) are
:mod:`gtpo.algorithms.shaping_params`. GROP, the length penalty that feeds the bases, is
:mod:`gtpo.algorithms.length_penalty` (App. D).
"""

from __future__ import annotations

import torch

from gtpo.algorithms.grpo_s import grpo_s_reference
from gtpo.algorithms.gtpo_token import gtpo_token_reference
from gtpo.algorithms.kernel_dispatch import kernel_guard, kernel_on
from gtpo.algorithms.shaping_inputs import check_responses, check_token_values, shaping_bases, validate_with_params
from gtpo.algorithms.shaping_params import GRPOSParams, GTPOParams

__all__ = ["gtpo_token_advantages", "grpo_s_advantages"]


def _on_cpu(*tensors) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


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
        params: :class:`gtpo.algorithms.shaping_params.GTPOParams` (None: the defaults).
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
        ValueError: on bad inputs (:func:`gtpo.algorithms.shaping_inputs.validate_shaping_inputs`) or a missing
            ``responses``.
    """
    params = params or GTPOParams()
    validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens=False)
    if params.conflict_mask:
        check_responses(responses, response_mask)
    correct = rewards.detach() > params.reward_threshold
    base = shaping_bases(rewards, correct, params.negative_base, reward_offset)
    if _on_cpu(entropy, response_mask, responses) and kernel_on("gtpo_token_kernel"):
        with kernel_guard("gtpo_token_kernel"):  # numba missing or failing: the definition below
            from gtpo.algorithms import gtpo_token_kernel

            return gtpo_token_kernel.gtpo_token_kernel(
                entropy, response_mask, correct.cpu(), base.cpu(), gid.cpu(), num_groups, params, responses
            )
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
        gid: ``[B]`` int64 group ids; num_groups: ``NG``.
        params: :class:`gtpo.algorithms.shaping_params.GRPOSParams` (None: defaults).
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
    if _on_cpu(entropy, response_mask) and kernel_on("grpo_s_kernel"):
        with kernel_guard("grpo_s_kernel"):  # numba missing or failing: the definition below
            from gtpo.algorithms import grpo_s_kernel

            return grpo_s_kernel.grpo_s_kernel(
                entropy, response_mask, correct.cpu(), base.cpu(), gid.cpu(), num_groups, params
            )
    check_token_values(entropy, response_mask.to(entropy.device), params.neg_entropy_tol)
    return grpo_s_reference(entropy, response_mask, rewards, gid, num_groups, params, reward_offset)
