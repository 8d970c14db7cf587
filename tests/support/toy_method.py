"""A toy method added the way docs/architecture.md ("Add a method") says: this file and its row, nothing else.

``toy``: each response's reward centred on its prompt group's mean, on every valid token, times ``1 + scale * (H /
mean H - 1)`` (the token's old-policy entropy over the batch mean): an entropy-shaped GRPO without the std, enough to
show that a new estimator gets its knobs (``algorithm.toy``), the entropy it declares it needs, the group ids, and
its metrics under ``toy/``. Imported in every process of a run through ``VERL_USE_EXTERNAL_MODULES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gtpo.knobs import check_real
from gtpo.methods import ENTROPY, Method
from gtpo.verl_plugin.register import register_method


@dataclass(frozen=True)
class ToyParams:
    """``algorithm.toy``: ``scale``, the weight of the entropy term (>= 0)."""

    scale: float = 0.5

    def __post_init__(self) -> None:
        check_real("scale", self.scale, lo=0.0)


@torch.no_grad()
def toy_advantages(entropy, response_mask, rewards, gid, num_groups, params, **_):
    """``(r_i - mean_g r) * (1 + scale * (H_{i,t} / mean H - 1))`` on valid tokens, 0 on padding."""
    mask = response_mask.to(torch.float64)
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, r) / count
    centred = r - mean[gid]
    h = torch.where(mask.bool(), entropy.to(torch.float64), 0.0)
    mean_h = float(h.sum() / mask.sum().clamp(min=1))
    weight = 1.0 + params.scale * (h / max(mean_h, 1e-6) - 1.0)
    advantages = (centred[:, None] * weight * mask).to(torch.float32)
    return advantages, {"mean_entropy": mean_h, "adv_abs_mean": float(advantages.abs().sum() / mask.sum().clamp(min=1))}


TOY = register_method(
    Method(
        "toy",
        "the recipe's docs, 'Add a method'",
        adv_estimator="toy",
        advantages=toy_advantages,
        knobs="toy",
        params=ToyParams,
        needs=(ENTROPY,),
    )
)
