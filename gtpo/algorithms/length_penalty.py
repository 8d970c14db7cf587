"""GROP: Group Relative Overlong Punishment (Tan et al., arXiv 2508.04349 v6, App. D; docs/ALGORITHMS.md §5).

Per prompt group with ``G`` responses, ``n`` correct, ``m = G - n`` incorrect, ``frac = n / G``:

- easy (``frac >= gamma1``): penalise the correct responses; knee ``L+`` over the correct lengths;
- hard (``frac <= 1 - gamma1``): "no response length punishment is set, or the same punishment as DAPO is set"
  (App. D): ``hard_mode="none"`` (default) or ``"dapo"`` (DAPO's soft overlong punishment, Eq. 13 of arXiv
  2503.14476, :func:`gtpo.algorithms.dapo.overlong_reward`, on every response of the group);
- medium (otherwise): knee ``L-`` over all ``G`` lengths; "if n > m", penalise the correct responses. For ``n <= m``
  the paper sets no punishment; ``medium_penalise_incorrect=True`` penalises the incorrect ones instead (an
  independent re-implementation's rule, not the paper's; off by default).

``gamma1``: the paper gives no value; 0.75 is the re-implementation's choice, not the paper's.

Knee ``L = max((min l + max l) / 2, mean l, 1)``; penalty ``R = 0`` if ``l < L``, ``-0.5 (l - L) / L`` if
``L <= l < 2L``, ``-0.5`` if ``l >= 2L``. The paper adds ``R`` to the reward before advantage estimation.

Choices where the source is silent: the cases are tested in the order easy, hard, medium (they only overlap when
``gamma1 = 0.5``, where ``frac = 0.5`` is easy); ``frac`` is compared with a 1e-9 tolerance so that e.g. 3 of 4
counts as ``>= 0.75`` whatever the float rounding of ``gamma1``; every row of a group counts in ``G`` and in the
knee, including a zero-length response (which, being shorter than ``L >= 1``, is never penalised).

Consequence of the knee definition: the penalised rows always belong to the knee's length set, and ``L >= (min + max)
/ 2`` there, so the ``-0.5`` plateau (``l >= 2L``) is reached only when that set holds a zero-length response; in
practice the penalty is the ramp, ``-0.5 * (l - L) / L``, which stays above ``-0.5``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from gtpo.algorithms.dapo import overlong_reward
from gtpo.algorithms.group_ops import per_row, segment_sum

__all__ = ["GROPParams", "grop_penalty", "grop_knee_and_target"]

_FRAC_TOL = 1e-9
HARD_MODES = ("none", "dapo")


@dataclass(frozen=True)
class GROPParams:
    """Knobs of GROP (``algorithm.grop``).

    Attributes:
        enable: add the GROP penalty to the sequence reward before GTPO / GRPO-S shaping.
        gamma1: accuracy threshold of an "easy" group; ``1 - gamma1`` bounds a "hard" group. The paper gives no
            value; 0.75 is not the paper's (an independent re-implementation's choice).
        medium_penalise_incorrect: in a medium group with ``n <= m``, penalise the incorrect responses (not the
            paper's rule, which punishes nothing there).
        hard_mode: ``"none"`` (no punishment in hard groups) or ``"dapo"`` (DAPO's soft overlong punishment).
        dapo_max_length: ``L_max`` of DAPO's punishment (``hard_mode="dapo"``; e.g. the max response length).
        dapo_buffer_length: ``L_cache`` of DAPO's punishment, ``0 < dapo_buffer_length < dapo_max_length``.
    """

    enable: bool = False
    gamma1: float = 0.75
    medium_penalise_incorrect: bool = False
    hard_mode: str = "none"
    dapo_max_length: int = 4096
    dapo_buffer_length: int = 512

    def __post_init__(self) -> None:
        for name in ("enable", "medium_penalise_incorrect"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be true or false")
        if self.hard_mode not in HARD_MODES:
            raise ValueError(f"hard_mode={self.hard_mode!r}: must be one of {list(HARD_MODES)}")
        for name in ("dapo_max_length", "dapo_buffer_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r}: must be a positive int")
        if self.dapo_buffer_length >= self.dapo_max_length:
            raise ValueError(
                f"dapo_buffer_length={self.dapo_buffer_length!r}: must be < dapo_max_length={self.dapo_max_length} "
                "(a buffer as long as the response budget punishes every response)"
            )
        g = self.gamma1
        if isinstance(g, bool) or not isinstance(g, Real) or not math.isfinite(float(g)):
            raise ValueError(f"gamma1={g!r}: must be a finite real number")
        if not 0.5 <= float(g) <= 1.0:
            raise ValueError(f"gamma1={g!r}: must lie in [0.5, 1] so that easy and hard groups do not overlap")


@torch.no_grad()
def grop_knee_and_target(
    lengths: torch.Tensor,
    correct: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    gamma1: float = 0.75,
    medium_penalise_incorrect: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group knee and the rows GROP's knee penalty applies to.

    Args:
        lengths: ``[B]`` response lengths (valid tokens). correct: ``[B]`` bool.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. gamma1: easy threshold.
        medium_penalise_incorrect: medium groups with ``n <= m`` target their incorrect responses (not the paper's).

    Returns:
        ``(knee [NG] float64, target [B] bool, case [NG] int64)`` with case 0 = hard, 1 = medium, 2 = easy.
        ``knee`` is 1 for hard groups (unused there).
    """
    ell = lengths.detach().to(torch.float64)
    c = correct.bool()
    gid = gid.to(torch.long)
    size = segment_sum(torch.ones_like(ell), gid, num_groups)
    n = segment_sum(c.to(torch.float64), gid, num_groups)
    frac = n / size.clamp(min=1)
    easy = frac >= gamma1 - _FRAC_TOL
    hard = ~easy & (frac <= 1.0 - gamma1 + _FRAC_TOL)
    medium = ~easy & ~hard
    # Rows entering the knee: the correct ones in an easy group, all rows otherwise.
    in_knee = torch.where(per_row(easy, gid), c, torch.ones_like(c))
    inf = torch.full((num_groups,), math.inf, dtype=torch.float64, device=ell.device)
    # rows outside the knee give +inf to the min and -inf to the max (no boolean gather, which torch runs in parallel)
    lo = inf.scatter_reduce(0, gid, torch.where(in_knee, ell, math.inf), reduce="amin", include_self=True)
    hi = (-inf).scatter_reduce(0, gid, torch.where(in_knee, ell, -math.inf), reduce="amax", include_self=True)
    cnt = segment_sum(in_knee.to(torch.float64), gid, num_groups)
    mean = segment_sum(torch.where(in_knee, ell, 0.0), gid, num_groups) / cnt.clamp(min=1)
    has = cnt > 0
    mid = torch.where(has, (lo + hi) / 2.0, 1.0)
    knee = torch.maximum(torch.maximum(mid, torch.where(has, mean, 1.0)), torch.ones_like(mid))
    knee = torch.where(hard, torch.ones_like(knee), knee)
    more_correct = n > size - n
    target_medium = torch.where(per_row(more_correct, gid), c, ~c if medium_penalise_incorrect else torch.zeros_like(c))
    target = torch.where(per_row(easy, gid), c, torch.where(per_row(medium, gid), target_medium, torch.zeros_like(c)))
    case = torch.where(easy, 2, torch.where(medium, 1, 0)).to(torch.long)
    return knee, target, case


@torch.no_grad()
def grop_penalty(
    lengths: torch.Tensor,
    correct: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    gamma1: float = 0.75,
    params: GROPParams | None = None,
) -> torch.Tensor:
    """GROP penalty per response (App. D), vectorised over groups.

    Args:
        lengths: ``[B]`` response lengths (e.g. ``response_mask.sum(-1)``). correct: ``[B]`` bool.
        gid: ``[B]`` int64 group ids in ``0 .. num_groups - 1`` (any row order, any group sizes).
        num_groups: ``NG``. gamma1: easy threshold (0.75: not the paper's value, which is not given).
        params: optional :class:`GROPParams`; when given, its ``gamma1``, ``medium_penalise_incorrect`` and
            ``hard_mode`` rule (``gamma1`` argument ignored).

    Returns:
        ``[B]`` float64 penalty, to be added to the sequence reward: in ``[-0.5, 0]`` from the knee rule, in
        ``[-1, 0]`` on hard groups under ``hard_mode="dapo"``.
    """
    b = lengths.shape[0] if isinstance(lengths, torch.Tensor) else None
    if b is None or lengths.dim() != 1:
        raise ValueError(f"lengths must be a [batch] tensor, got {getattr(lengths, 'shape', type(lengths).__name__)}")
    if not isinstance(correct, torch.Tensor) or tuple(correct.shape) != (b,):
        raise ValueError(f"correct must have shape [{b}], got {getattr(correct, 'shape', type(correct).__name__)}")
    if not isinstance(gid, torch.Tensor) or tuple(gid.shape) != (b,):
        raise ValueError(f"gid must have shape [{b}], got {getattr(gid, 'shape', type(gid).__name__)}")
    if b and (int(gid.min()) < 0 or int(gid.max()) >= num_groups):
        raise ValueError(f"gid values must lie in [0, {num_groups - 1}], got [{int(gid.min())}, {int(gid.max())}]")
    if b and (not bool(torch.isfinite(lengths.to(torch.float64)).all()) or float(lengths.min()) < 0):
        raise ValueError("lengths must be finite and >= 0")
    if params is not None:
        gamma1 = params.gamma1
    medium_incorrect = params is not None and params.medium_penalise_incorrect
    knee, target, case = grop_knee_and_target(lengths, correct, gid, num_groups, float(gamma1), medium_incorrect)
    ell = lengths.detach().to(torch.float64)
    k = per_row(knee, gid.to(torch.long))
    ramp = -0.5 * (ell - k) / k
    pen = torch.where(ell <= k, torch.zeros_like(ell), torch.where(ell < 2.0 * k, ramp, torch.full_like(ell, -0.5)))
    pen = torch.where(target, pen, torch.zeros_like(pen))
    if params is not None and params.hard_mode == "dapo":
        hard = per_row(case, gid.to(torch.long)) == 0
        dapo = overlong_reward(ell, params.dapo_max_length, params.dapo_buffer_length).to(torch.float64)
        pen = torch.where(hard, dapo, pen)
    return pen
