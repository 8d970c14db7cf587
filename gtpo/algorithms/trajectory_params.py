"""GTPO-trajectory's knobs (Simoni et al., arXiv 2508.03772, TACL 2026): the two variants of §6.5 and their defaults.

Paper: Simoni, Fontana, Rossolini, Saracino (, Mori), "GTPO: Trajectory-Based Policy Optimization in LLMs", arXiv
2508.03772; official code ``winstonsmith1897/GTPO``; specification docs/ALGORITHMS.md §6.5-6.7, §11.
``variant="paper"`` gives the knobs the paper's values (conflict weights ``lambda_pos = 2`` / ``lambda_neg = 0``,
entropy penalty ``gamma``, filter threshold ``tau = ln 2`` behind the ini gate, ``n_conf`` the union of the runs,
the mean over prompts); ``variant="code"`` the official code's (``tau = 0.7``, no gate, ``1/max(f, b)``, the sum
over a group). Every field left at None takes its variant's default; an explicit value always wins. The deliberate
deviations from both are listed in :mod:`gtpo.algorithms.trajectory`; the estimator that reads these knobs is there
too. Its result, :class:`GTPOTrajOutput`, and its check of the entropy values are here as well: the definition and
the compiled kernel (:mod:`gtpo.algorithms.trajectory_kernel`) both use them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch

from gtpo.algorithms.conflict_tokens import NCONF_COUNTS

__all__ = ["LN2", "ADV_NORMS", "GTPOTrajParams", "GTPOTrajOutput", "check_entropy_values"]

LN2 = math.log(2.0)

_VARIANTS = ("paper", "code")
ADV_NORMS = ("std", "none")
_AGGS = ("paper_mean", "code_sum")
# Defaults each variant gives to the knobs left at None (docs/ALGORITHMS.md §6.5 table).
_VARIANT_DEFAULTS = {
    "paper": {
        "adv_norm": "std",
        "use_ini_gate": True,
        "tau": LN2,
        "divide_by_nconf": False,
        "nconf_count": "union",
        "agg": "paper_mean",
        "skip_zero_adv_groups": True,
    },
    "code": {
        "adv_norm": "none",
        "use_ini_gate": False,
        "tau": 0.7,
        "divide_by_nconf": True,
        "nconf_count": "official",
        "agg": "code_sum",
        "skip_zero_adv_groups": False,
    },
}


@dataclasses.dataclass(frozen=True)
class GTPOTrajParams:
    """Knobs of ``algorithm.gtpo_traj`` (docs/ALGORITHMS.md §6.5–6.7, §11).

    Fields left at ``None`` take the default of ``variant`` (see ``_VARIANT_DEFAULTS``); an explicit value always
    wins. After construction every field holds a concrete value.
    """

    variant: str = "paper"
    lam_pos: float = 2.0
    lam_neg: float = 0.0
    gamma: float = 0.1
    tau: float | None = None
    use_ini_gate: bool | None = None
    h_ini: float | None = None
    adv_norm: str | None = None
    divide_by_nconf: bool | None = None
    nconf_count: str | None = None
    agg: str | None = None
    skip_zero_adv_groups: bool | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.variant not in _VARIANTS:
            raise ValueError(f"variant={self.variant!r}: must be one of {list(_VARIANTS)}")
        for name, value in _VARIANT_DEFAULTS[self.variant].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("lam_pos", "lam_neg", "gamma", "tau", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r}: must be a number")
            object.__setattr__(self, name, float(value))
        if not (math.isfinite(self.lam_pos) and self.lam_pos >= 0):
            raise ValueError(f"lam_pos={self.lam_pos}: must be a finite number >= 0")
        if not (math.isfinite(self.lam_neg) and self.lam_neg >= 0):
            raise ValueError(f"lam_neg={self.lam_neg}: must be a finite number >= 0")
        if not (math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(f"gamma={self.gamma}: must be a finite number >= 0")
        if math.isnan(self.tau) or self.tau < 0:
            raise ValueError(f"tau={self.tau}: must be >= 0 (use .inf to disable the entropy filter)")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps={self.eps}: must be a finite number > 0")
        for name in ("use_ini_gate", "divide_by_nconf", "skip_zero_adv_groups"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be true or false")
        if self.adv_norm not in ADV_NORMS:
            raise ValueError(f"adv_norm={self.adv_norm!r}: must be one of {list(ADV_NORMS)}")
        if self.nconf_count not in NCONF_COUNTS:
            raise ValueError(f"nconf_count={self.nconf_count!r}: must be one of {list(NCONF_COUNTS)}")
        if self.agg not in _AGGS:
            raise ValueError(f"agg={self.agg!r}: must be one of {list(_AGGS)}")
        if self.h_ini is not None:
            if isinstance(self.h_ini, bool) or not isinstance(self.h_ini, (int, float)):
                raise ValueError(f"h_ini={self.h_ini!r}: must be a number or null")
            if not (math.isfinite(self.h_ini) and self.h_ini >= 0):
                raise ValueError(f"h_ini={self.h_ini}: must be a finite entropy >= 0 (nats) or null")
            object.__setattr__(self, "h_ini", float(self.h_ini))


class GTPOTrajOutput(NamedTuple):
    """Result of :func:`gtpo_traj_advantages` (all tensors detached).

    The conflict weights are kept as run lengths (the first ``run_fwd`` and the last ``run_bwd`` valid columns of a
    row, ending at column ``last``); :attr:`lam` and :attr:`is_conflict` expand them to ``[B, L]`` on request.
    """

    advantages: torch.Tensor  # [B, L] float32, zero on padding
    adv_seq: torch.Tensor  # [B] float32, A_i (unshaped, after adv_norm)
    shaped_seq: torch.Tensor  # [B] float32, A'_i = delta_i (A_i - gamma <H>_i), after group skipping and agg scale
    mean_entropy: torch.Tensor  # [B] float32, <H>_i
    delta: torch.Tensor  # [B] float32 in {0, 1}
    polarity: torch.Tensor  # [B] int8
    n_conf: torch.Tensor  # [B] int64 divisor (>= 1)
    run_fwd: torch.Tensor  # [B] int64 length of the leading conflict run
    run_bwd: torch.Tensor  # [B] int64 length of the trailing conflict run
    last: torch.Tensor  # [B] int64 last valid column (-1: empty row)
    lam_c: torch.Tensor  # [B] float32 weight of the row's conflict tokens (lam_pos / lam_neg; 1 if inactive)
    response_mask: torch.Tensor  # [B, L] the mask the runs refer to
    h_ini: float | None  # <H>_ini used (measured on this batch with measure_h_ini)
    metrics: dict

    def _runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = self.response_mask.bool()
        cols = torch.arange(valid.shape[-1], device=valid.device)[None, :]
        fwd = cols < self.run_fwd[:, None]
        bwd = cols > (self.last - self.run_bwd)[:, None]
        return valid, fwd & valid, bwd & valid

    @property
    def is_conflict(self) -> torch.Tensor:
        """``[B, L]`` bool: tokens of the leading (forward) or trailing (backward, right-aligned) run."""
        _, fwd, bwd = self._runs()
        return fwd | bwd

    @property
    def lam(self) -> torch.Tensor:
        """``[B, L]`` float32 ``lambda_fwd * lambda_bwd * m`` (``lam_c`` per run, ``lam_c ** 2`` in both)."""
        valid, fwd, bwd = self._runs()
        lam_c = self.lam_c[:, None]
        one = torch.ones((), dtype=torch.float32, device=valid.device)
        return valid.to(torch.float32) * torch.where(fwd, lam_c, one) * torch.where(bwd, lam_c, one)


def check_entropy_values(entropy: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Raise naming the count of NaN / inf entropies on valid tokens (padding may hold anything)."""
    valid = response_mask.bool()
    h = entropy.detach()
    for name, bad in (("NaN", torch.isnan(h)), ("inf", torch.isinf(h))):
        count = int((bad & valid).sum())
        if count:
            raise ValueError(f"entropy holds {name} on {count} valid token(s)")
