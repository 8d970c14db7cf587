"""Chunked passes over verl's ``[batch, response_len]`` tensors, shared by the entropy-shaped estimators.

Not an equation module: the scheduling of ``[B, L]`` work for :mod:`gtpo.algorithms.gtpo_token` and
:mod:`gtpo.algorithms.grpo_s` (arXiv 2508.04349). Rows are processed in chunks of about ``2**21`` tokens on CPU
(every temporary stays in cache) and one chunk per batch on GPU. Entropy and mask checks run on each chunk (one
min/max per chunk); when one fails, :func:`gtpo.algorithms.entropy_shaping.check_token_values` raises the precise
error. A chunk whose padding holds NaN/inf/negative entropies takes a masked (``where``) path, so padding is never
read.
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.entropy_shaping import check_token_values

__all__ = [
    "CPU_CHUNK_TOKENS",
    "CUDA_CHUNK_TOKENS",
    "chunk_tokens",
    "chunk_rows",
    "TokenChecker",
    "masked_row_sums",
    "broadcast_rows",
]

# tokens per chunk: ~8 MB of float32 per temporary on CPU (L2/L3-resident); one chunk per batch on GPU
CPU_CHUNK_TOKENS = 1 << 21
CUDA_CHUNK_TOKENS = 1 << 28

_F64 = torch.float64
_F32 = torch.float32


def chunk_tokens(device: torch.device) -> int:
    """Tokens per chunk on ``device`` (read at call time, so tests can shrink it)."""
    return CUDA_CHUNK_TOKENS if device.type == "cuda" else CPU_CHUNK_TOKENS


def chunk_rows(device: torch.device, length: int) -> int:
    """Rows per chunk of ``length``-token rows on ``device`` (at least 1)."""
    return max(1, chunk_tokens(device) // max(length, 1))


class TokenChecker:
    """Chunk-wise entropy / mask checks; defers to the full check (which raises) when a chunk looks wrong."""

    def __init__(self, entropy, response_mask, tol):
        self.entropy, self.mask, self.tol = entropy, response_mask, tol
        self.mask_is_bool = response_mask.dtype == torch.bool
        self.dirty = False  # some checked chunk needed the masked path (non-finite or negative values)

    def fail(self):
        check_token_values(self.entropy, self.mask, self.tol)
        raise ValueError("entropy / response_mask failed a consistency check")  # pragma: no cover

    def masked_entropy(self, h, mf, lens, inplace=True, checked=False):
        """``h`` masked to the valid tokens (in place if ``inplace``), negatives within tolerance clamped to 0.

        ``checked=True``: these rows already passed this checker in an earlier pass; the checks are not repeated,
        only their outcome is reused (multiply by the mask if no chunk needed the masked path, else select).

        Returns ``(hm, hsum, clamped)``: ``hsum`` the row sums before clamping (the reference's entropy
        diagnostics), ``clamped`` whether any negative value may have been clamped.
        """
        if h.numel() == 0:
            return h, h.sum(-1), False
        if checked and not self.dirty:
            hm = h.mul_(mf) if inplace else h * mf
            return hm, hm.sum(-1), False
        if not checked:
            checks = [*torch.aminmax(h)]
            if not self.mask_is_bool:
                checks += [*torch.aminmax(mf), (torch.linalg.vecdot(mf, mf) - lens).abs().max()]
            vals = torch.stack(checks).tolist()
            if not self.mask_is_bool and not (vals[2] >= 0.0 and vals[3] <= 1.0 and vals[4] == 0.0):
                self.fail()
            if vals[0] >= 0.0 and math.isfinite(vals[1]):
                hm = h.mul_(mf) if inplace else h * mf
                return hm, hm.sum(-1), False
            self.dirty = True
        # padding may hold anything (NaN, inf, negatives): select instead of multiplying
        hm = torch.where(mf != 0, h, torch.zeros((), dtype=h.dtype, device=h.device))
        lo, hi = torch.aminmax(hm)
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo < -self.tol:
            self.fail()
        hsum = hm.sum(-1)
        if lo < 0:
            hm.clamp_min_(0.0)
        return hm, hsum, lo < 0


def float32_chunk(entropy: torch.Tensor, mask: torch.Tensor, r0: int, r1: int):
    """Rows ``r0:r1`` as float32: ``(entropy [r, L], own, mask [r, L])``; ``own`` is True when the entropy chunk is a
    fresh copy (not a view of the caller's tensor), so it may be modified in place."""
    h = entropy[r0:r1].detach()
    own = h.dtype != _F32
    h = h.to(_F32) if own else h
    mk = mask[r0:r1]
    return h, own, (mk if mk.dtype == _F32 else mk.to(_F32))


@torch.no_grad()
def masked_row_sums(entropy: torch.Tensor, response_mask: torch.Tensor, neg_entropy_tol: float):
    """Checked per-row sums for the sequence-level estimators (GRPO-S): one chunked pass over ``[B, L]``.

    Runs the token-value checks of ``validate_shaping_inputs`` (raising its precise error) and returns
    ``(entropy_sum [B] float64, length [B] float64)`` over the valid tokens, negative entropies (within tolerance)
    clamped to 0 token by token; padding is never read.
    """
    b, length = entropy.shape
    device = entropy.device
    mask = response_mask.to(device)
    checker = TokenChecker(entropy, mask, float(neg_entropy_tol))
    hsum = torch.zeros(b, dtype=_F64, device=device)
    lens = torch.zeros(b, dtype=_F64, device=device)
    step = chunk_rows(device, length)
    for r0 in range(0, b, step):
        r1 = min(b, r0 + step)
        h, own, mf = float32_chunk(entropy, mask, r0, r1)
        ln = mf.sum(-1)
        hm, hs, clamped = checker.masked_entropy(h, mf, ln, inplace=own)
        hsum[r0:r1] = (hm.sum(-1) if clamped else hs).to(_F64)
        lens[r0:r1] = ln.to(_F64)
    return hsum, lens


@torch.no_grad()
def broadcast_rows(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``values[:, None] * mask`` as float32 ``[B, L]`` (one pass; the mask may be bool, int or float)."""
    mask = response_mask.to(values.device)
    v = values.to(_F32)[:, None]
    if mask.dtype == _F32:
        return mask * v
    out = torch.empty(mask.shape, dtype=_F32, device=mask.device)
    b, length = mask.shape
    step = chunk_rows(mask.device, length)
    for r0 in range(0, b, step):
        r1 = min(b, r0 + step)
        torch.mul(mask[r0:r1].to(_F32), v[r0:r1], out=out[r0:r1])
    return out
