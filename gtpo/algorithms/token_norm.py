"""GTPO's Eq. 6 normalisation modes as set statistics over per-row sums (Tan et al., arXiv 2508.04349, §2.2).

A whitening set is a collection of valid tokens; the advantage of a token is ``(x - mean) / (std + eps)`` over the
set it reads its statistics from. With ``w`` the count-scaled entropy weight of a token (``share * d_t``, or
``share * h_t`` on incorrect rows) the shaped reward of row ``i`` is ``x = a1*base_i + s_i*a2*w`` (``s_i = +-1``),
so every set statistic follows from per-row sums.

- ``split``: set = the tokens of one polarity (within the scope).
- ``joint``: set = all valid tokens of the scope, signed shaped rewards.
- ``zero_fill`` (the paper's Eq. 3 / 5 / 6): the r~+ field is r~+ on correct tokens and 0 on incorrect ones, over
  all valid tokens of the scope; r~- likewise. A row reads the field of its own polarity, so its set is the
  ``split`` set plus ``n_zeros`` zero-valued tokens (the other polarity's tokens in the same scope).

Set layout (:func:`set_layout`): polarity-major ids (correct sets first) for ``split`` and ``zero_fill``, one id per
scope for ``joint``.
"""

from __future__ import annotations

import torch

from gtpo.algorithms.group_ops import segment_sum

__all__ = ["set_layout", "zero_counts", "set_scales"]


def set_layout(norm_mode: str, polarity_seg: torch.Tensor, scope_id: torch.Tensor, n_scopes: int):
    """``(set id [R], n_sets)`` of each row.

    Args:
        norm_mode: ``"zero_fill"``, ``"joint"`` or ``"split"``.
        polarity_seg: ``[R]`` int64 ``polarity * n_scopes + scope_id`` (polarity 0 = correct).
        scope_id: ``[R]`` int64 scope (group or 0 for the batch). n_scopes: number of scopes.
    """
    if norm_mode == "joint":
        return scope_id, n_scopes
    return polarity_seg, 2 * n_scopes


def zero_counts(norm_mode: str, set_tokens: torch.Tensor) -> torch.Tensor | None:
    """Zero-valued tokens each set holds besides its rows' own: the other polarity's tokens (``zero_fill`` only).

    ``set_tokens``: ``[n_sets]`` valid tokens of each set's rows in the polarity-major layout.
    """
    if norm_mode != "zero_fill":
        return None
    half = set_tokens.shape[0] // 2
    return torch.cat([set_tokens[half:], set_tokens[:half]])


def set_scales(st, set_ids, n_sets, a1, a2, unbiased, eps, rtol, n_zeros=None):
    """Per-row ``(beta, gamma)`` with ``advantage = beta * (w - k) + gamma`` on the row's valid tokens.

    Args:
        st: dict of float64 ``[R]`` per-row columns: ``lens`` (valid tokens), ``base``, ``sign`` (+-1), ``sw``
            (sum of ``w``), ``k`` (the row's centre), ``ssq`` (sum of ``(w - k)^2``), ``absr`` (sum of ``|x|``).
        set_ids: ``[R]`` int64 set of each row; n_sets: number of sets.
        a1, a2, eps: the GTPO knobs; unbiased: Bessel-corrected std; rtol: ``zero_var_rtol``.
        n_zeros: optional ``[n_sets]`` float64 count of zero-valued tokens each set holds (``zero_fill``).

    A set with fewer than two tokens or ``std <= rtol * mean|x|`` is constant: its rows get ``beta = gamma = 0``.
    The sum of squares is centred per row at ``k`` (a two-pass variance), so near-constant sets are measured to
    the precision of ``w - k``, not to cancellation noise.
    """
    lens, base, sgn, sw, k, ssq, absr = (st[n] for n in ("lens", "base", "sign", "sw", "k", "ssq", "absr"))
    n = segment_sum(lens, set_ids, n_sets)
    if n_zeros is not None:
        n = n + n_zeros
    mean = segment_sum(a1 * base * lens + sgn * a2 * sw, set_ids, n_sets) / n.clamp(min=1)
    e = a1 * base + sgn * a2 * k - mean[set_ids]
    sz = sw - k * lens
    ss = segment_sum(a2 * a2 * ssq + 2.0 * sgn * a2 * e * sz + e * e * lens, set_ids, n_sets)
    if n_zeros is not None:
        ss = ss + n_zeros * mean * mean
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    std = (ss.clamp(min=0) / denom).sqrt()
    std = torch.where(n > 1, std, torch.zeros_like(std))
    abs_mean = segment_sum(absr, set_ids, n_sets) / n.clamp(min=1)
    constant = (n <= 1) | (std <= rtol * abs_mean)
    inv = torch.where(constant, torch.zeros_like(std), 1.0 / (std + eps))[set_ids]
    return sgn * a2 * inv, e * inv
