"""Group reductions over verl's padded ``[batch, response_len]`` layout.

Group membership is always an int64 tensor of group ids ``gid`` of shape ``[B]`` with values in
``0 .. num_groups - 1``, never a row position: verl reorders rows when it balances batches, and groups may
differ in size. Every reduction is a scatter-add (``index_add_``), so memory is O(B * L) and no Python loop
runs over groups or tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "group_ids",
    "segment_sum",
    "group_mean_std",
    "per_row",
]


def group_ids(index: Sequence | np.ndarray | torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group labels (verl's ``uid`` strings) to dense int64 group ids.

    Args:
        index: ``[B]`` labels; rows of one group share a label. Any order.

    Returns:
        ``(gid, num_groups)``: ``gid`` is an int64 tensor ``[B]`` with values in ``0 .. num_groups - 1``, numbered
        by first appearance, so the mapping does not depend on how labels sort.
    """
    if isinstance(index, torch.Tensor):
        labels = index.detach().cpu().numpy()
    else:
        labels = np.asarray(index, dtype=object) if not isinstance(index, np.ndarray) else index
    if labels.ndim != 1:
        raise ValueError(f"index must be one-dimensional [batch], got shape {tuple(labels.shape)}")
    if labels.size == 0:
        return torch.zeros(0, dtype=torch.long), 0
    # np.unique on object arrays needs comparable labels; str() makes mixed types comparable.
    keys = labels.astype(str) if labels.dtype == object else labels
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    # Renumber by first appearance.
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    gid = torch.as_tensor(rank[inverse.reshape(-1)], dtype=torch.long)
    return gid, int(order.size)


def _on_numpy(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and not t.requires_grad for t in tensors)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """``x.sqrt()``; on CPU through numpy, because torch runs even a ``[NG]`` sqrt as an OpenMP parallel region, whose
    pool then spins on the cores a compiled kernel started right after needs."""
    return torch.from_numpy(np.sqrt(x.numpy())) if _on_numpy(x) else x.sqrt()


def per_row(values: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """``values[gid]``: each row's entry of a per-group ``[NG, ...]`` tensor, as ``[B, ...]``.

    On CPU through numpy, for the reason of :func:`_sqrt` (torch gathers a few thousand rows on its OpenMP pool).
    """
    if _on_numpy(values, gid):
        return torch.from_numpy(values.numpy()[gid.numpy()])
    return values[gid]


def segment_sum(x: torch.Tensor, gid: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group sums: ``out[g] = sum_{b: gid[b] == g} x[b]``.

    Args:
        x: ``[B, ...]`` values.
        gid: ``[B]`` int64 group ids.
        num_groups: number of groups ``NG``.

    Returns:
        ``[NG, ...]`` sums in ``x``'s dtype.
    """
    out = torch.zeros((num_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add_(0, gid, x)


def group_mean_std(
    values: torch.Tensor, gid: torch.Tensor, num_groups: int, unbiased: bool = True, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group mean, std and count of one value per row.

    Args:
        values: ``[B]`` float values.
        gid: ``[B]`` int64 group ids.
        num_groups: ``NG``.
        unbiased: divide the variance by ``count - 1`` (``torch.std``'s default) instead of ``count``.
        valid: optional ``[B]`` bool; rows outside it are left out of the statistics.

    Returns:
        ``(mean, std, count)``, each ``[NG]``. A group with one row has std 0; a group with no row mean 0.
    """
    v = values.to(torch.float64)
    w = torch.ones_like(v) if valid is None else valid.to(torch.float64)
    count = segment_sum(w, gid, num_groups)
    mean = segment_sum(v * w, gid, num_groups) / count.clamp(min=1)
    centred = (v - per_row(mean, gid)) * w
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    std = _sqrt(segment_sum(centred * centred, gid, num_groups) / denom)
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return mean.to(values.dtype), std.to(values.dtype), count.to(torch.long)
