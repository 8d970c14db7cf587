"""Forking-token selection: keep the top-rho highest-entropy tokens (DAPO w/ Forking Tokens).

Paper: Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning
for LLM Reasoning", arXiv 2506.01939 v2, §5.1-5.2 (docs/ALGORITHMS.md §7.3):

    J_HighEnt = E[ 1 / sum_{i,t} I[H_t^i >= tau_rho] * sum_{i,t} I[H_t^i >= tau_rho] * min(r A, clip(r) A) ]

with ``tau_rho`` the entropy quantile of the (micro-)batch that keeps the top ``rho`` fraction (rho = 0.2).

Quantile convention (deliberate, documented): over the ``n`` tokens of the given set (valid tokens only, padding
never counts), ``k = ceil(rho * n)`` and ``tau_rho`` is the k-th largest entropy (an order statistic, no
interpolation). A token is selected iff it is in the set and ``H >= tau_rho``. Ties at the threshold are all
selected, so the selection depends only on the values (never on row order or sort stability: deterministic and
permutation-invariant); the selected count is exactly ``k`` without ties and ``>= k`` with ties (bf16 entropies
tie often; the adapter reports the realised fraction). The mask is a bool tensor built under ``no_grad``: no
gradient flows through it.

Under ``algorithm.forking.scope=batch`` the threshold is taken once over the whole training batch on the driver
(:func:`batch_threshold_extra_info`) and handed to the actor workers' loss in ``batch.extra_info`` under
:data:`THRESHOLD_KEY` and :data:`FRACTION_KEY`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gtpo.knobs import check_choice, check_flag

__all__ = [
    "FRACTION_KEY",
    "THRESHOLD_KEY",
    "ForkingParams",
    "batch_threshold_extra_info",
    "entropy_threshold",
    "top_entropy_mask",
]

# The names the driver's whole-batch threshold and realised selected fraction travel under to the workers' loss.
THRESHOLD_KEY = "forking_entropy_threshold"
FRACTION_KEY = "forking_selected_frac"


SCOPES = ("micro_batch", "batch")


@dataclass(frozen=True)
class ForkingParams:
    """``algorithm.forking``.

    Attributes:
        enable: restrict the policy gradient to the forking tokens (the recipe's trainers install the forking loss).
        rho: kept fraction of highest-entropy tokens (paper 0.2).
        scope: ``micro_batch`` (the training policy's entropy quantile per micro-batch, the paper's) or ``batch``
            (the old policy's entropy over the whole batch, taken on the driver).
    """

    enable: bool = False
    rho: float = 0.2
    scope: str = "micro_batch"

    def __post_init__(self) -> None:
        check_flag("enable", self.enable)
        _check_rho(self.rho)
        object.__setattr__(self, "rho", float(self.rho))
        check_choice("scope", self.scope, SCOPES)

    @property
    def needs(self) -> tuple[str, ...]:
        """What the forking loss needs from the batch: the old policy's entropy under ``scope=batch``."""
        return ("entropy",) if self.enable and self.scope == "batch" else ()


def _check_rho(rho: float) -> None:
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not (0.0 < rho <= 1.0):
        raise ValueError(f"rho={rho!r}: must be a number in (0, 1]")


@torch.no_grad()
def entropy_threshold(entropy: torch.Tensor, valid: torch.Tensor, rho: float) -> tuple[torch.Tensor, int]:
    """``tau_rho``: the k-th largest entropy among the valid tokens, ``k = ceil(rho * n)``.

    Args:
        entropy: ``[...]`` float per-token entropy (any shape; detached internally).
        valid: bool tensor of the same shape: the token set the quantile is taken over.
        rho: kept fraction in (0, 1].

    Returns:
        ``(tau, k)``: ``tau`` a 0-dim float tensor (``+inf`` when the set is empty, so nothing is selected), ``k``
        the nominal number of selected tokens.
    """
    _check_rho(rho)
    if entropy.shape != valid.shape:
        raise ValueError(f"entropy shape {tuple(entropy.shape)} != mask shape {tuple(valid.shape)}")
    values = entropy.detach()[valid.bool()].to(torch.float32)
    n = values.numel()
    if n == 0:
        return torch.tensor(math.inf, device=entropy.device), 0
    if bool(torch.isnan(values).any()):
        raise ValueError("entropy holds NaN on a valid token")
    k = min(n, max(1, math.ceil(rho * n - 1e-9)))
    # k-th largest == (n - k + 1)-th smallest.
    tau = torch.kthvalue(values, n - k + 1).values
    return tau, k


@torch.no_grad()
def top_entropy_mask(
    entropy: torch.Tensor, valid: torch.Tensor, rho: float = 0.2, threshold: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forking-token mask: valid tokens whose entropy is at least the top-rho threshold.

    Args:
        entropy: ``[B, L]`` per-token entropy (may require grad; it is detached).
        valid: ``[B, L]`` 0/1 mask of the token set (response tokens; padding excluded).
        rho: kept fraction in (0, 1] (paper: 0.2).
        threshold: a precomputed ``tau`` (e.g. a batch-level threshold); when None it is computed over ``valid``.

    Returns:
        ``(mask [B, L] bool, tau 0-dim float)``; ``mask`` is False on every invalid token.
    """
    valid_b = valid.bool()
    if threshold is None:
        tau, _ = entropy_threshold(entropy, valid_b, rho)
    else:
        _check_rho(rho)
        tau = torch.as_tensor(threshold, dtype=torch.float32, device=entropy.device)
    mask = valid_b & (entropy.detach().to(torch.float32) >= tau)
    return mask, tau


@torch.no_grad()
def batch_threshold_extra_info(entropy: torch.Tensor, response_mask: torch.Tensor, rho: float) -> dict[str, float]:
    """Driver side of ``scope=batch``: the whole batch's threshold and realised selected fraction.

    Args:
        entropy: ``[B, L]`` old-policy per-token entropy of the whole training batch (padded).
        response_mask: ``[B, L]`` 0/1.
        rho: kept fraction.

    Returns:
        ``{THRESHOLD_KEY: tau_B, FRACTION_KEY: n_sel / n_valid}`` to merge into ``batch.extra_info`` before
        ``_update_actor``; also log them as ``forking/batch_entropy_threshold`` / ``forking/batch_selected_frac``.
    """
    valid = response_mask.bool()
    selected, tau = top_entropy_mask(entropy, valid, rho)
    frac = float(selected.sum()) / max(float(valid.sum()), 1.0)
    return {THRESHOLD_KEY: float(tau) if torch.isfinite(tau) else float("inf"), FRACTION_KEY: frac}
