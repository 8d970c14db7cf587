"""GTPO-trajectory's entropy side: the mean completion entropy ``<H>_i`` and the filter ``delta_i``.

Paper: Simoni et al., arXiv 2508.03772 (TACL 2026); official code ``winstonsmith1897/GTPO``. Specification:
docs/ALGORITHMS.md §6.1 (the paper's 3-case ``delta``), §6.3 (the code's always-on filter).

Deliberate choice: ``<H>_ini`` (ini gate) is the mean over the first batch's completions of ``<H>_i`` (same scale as
the per-completion comparison). At ``<H>_ini == tau`` the filter is on. The gate compares ``<H>_ini`` with ``tau``
(``ln 2`` under ``variant=paper``), a single threshold for both cases of the paper's ``delta``.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean_entropy", "masked_row_sums", "entropy_filter"]


@torch.no_grad()
def masked_mean_entropy(entropy: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``<H>_i``: mean token entropy over the valid tokens of each row; ``[B, L] -> [B]`` float32 (0 if empty)."""
    total, count = masked_row_sums(entropy, response_mask)
    return (total / count.clamp(min=1)).to(torch.float32)


def masked_row_sums(x: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_t x * m, sum_t m)`` per row as float64 ``[B]``, in row chunks (no ``[B, L]`` temporary)."""
    b, length = x.shape
    total = torch.zeros(b, dtype=torch.float64, device=x.device)
    count = torch.zeros(b, dtype=torch.float64, device=x.device)
    step = max(1, (1 << 21) // max(length, 1)) if x.device.type == "cpu" else max(b, 1)
    for r0 in range(0, b, step):
        r1 = min(b, r0 + step)
        m = response_mask[r0:r1].to(device=x.device, dtype=torch.float32)
        xs = x[r0:r1].detach()
        xs = xs.to(torch.float32) if xs.dtype not in (torch.float32, torch.float64) else xs
        total[r0:r1] = (xs * m.to(xs.dtype)).sum(-1, dtype=torch.float64)
        count[r0:r1] = m.sum(-1, dtype=torch.float64)
    return total, count


@torch.no_grad()
def entropy_filter(mean_entropy: torch.Tensor, tau: float, use_ini_gate: bool, h_ini: float | None) -> torch.Tensor:
    """``delta_i`` (§6.1 / §6.3): 1 keeps completion ``i``, 0 drops it.

    Args:
        mean_entropy: ``[B]`` ``<H>_i``.
        tau: threshold (kept when ``<H>_i <= tau``; ``inf`` disables the filter).
        use_ini_gate: the paper's 3-case ``delta``: filter only when ``<H>_ini <= tau``, else keep every completion.
        h_ini: ``<H>_ini`` (required when ``use_ini_gate``).

    Returns:
        ``[B]`` float32 in {0, 1}.
    """
    if use_ini_gate:
        if h_ini is None:
            raise ValueError("h_ini=None: the ini gate needs the initial model's mean entropy")
        if h_ini > tau:
            return torch.ones_like(mean_entropy, dtype=torch.float32)
    return (mean_entropy <= tau).to(torch.float32)
