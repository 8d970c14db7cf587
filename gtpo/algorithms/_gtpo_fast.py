"""Chunked evaluation of GTPO-token advantages (arXiv 2508.04349, Eq. 3, 5, 6).

Implements :func:`gtpo.algorithms.entropy_shaping.gtpo_token_advantages` with the same equations, knobs, edge cases
and diagnostics as the float64 reference ``_gtpo_token_advantages_reference`` in that module; results agree to
float32 rounding. Only the scheduling of the ``[B, L]`` work differs:

- Rows are ordered by group and processed in chunks of whole groups (about ``2**21`` tokens on CPU), the correct
  rows of a chunk first. The per-position sums of a group (the denominators of Eq. 3 / Eq. 5 and the counts
  ``d_t`` / ``h_t``) are therefore complete inside its chunk, every ``[B, L]`` temporary is chunk-sized (it stays in
  cache and is reused instead of freshly paged in), and memory beyond the output is O(chunk).
- Token arithmetic is float32; every mean, variance and sum over rows or sets is float64 over per-row partial sums.
- The whitening is algebraic. With ``w`` the count-scaled entropy weight (``share * d_t``; ``share * h_t`` for
  incorrect rows) the shaped reward of row ``i`` is ``x = a1*base_i + s_i*a2*w`` (``s_i = +-1``), so the set means,
  variances and ``mean|x|`` follow from per-row sums of ``w`` and of ``(w - k_i)^2``, with ``k_i`` the value of
  ``w`` at which ``x`` equals its set's mean (a per-row shift, i.e. a two-pass variance: near-constant sets are
  measured to float32 resolution, not to cancellation noise, which the zero-variance rule needs). The advantage of
  a valid token is then ``beta_i * (w - k_i) + gamma_i`` (``gamma_i`` only absorbs the rounding of ``k_i``, or the
  whole advantage when ``a2 = 0``).
- ``norm_scope="batch"`` centres each chunk on its own set means first, combines the per-row sums exactly in
  float64, then rescales the stored rows in a second chunked pass.
- Entropy and mask checks run on each chunk (one min/max per chunk); when one fails, the full check of
  :func:`gtpo.algorithms.entropy_shaping.validate_shaping_inputs` raises the precise error. A chunk whose padding
  holds NaN/inf/negative entropies takes a masked (``where``) path, so padding is never read.
- The conservation error diagnostic is read off the per-position sums (``a2 * eps * max_t d_t / (S_t + eps)``).
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.group_ops import segment_sum

__all__ = ["gtpo_fast", "CPU_CHUNK_TOKENS", "CUDA_CHUNK_TOKENS"]

# tokens per chunk: ~8 MB of float32 per temporary on CPU (L2/L3-resident); one chunk per batch on GPU
CPU_CHUNK_TOKENS = 1 << 21
CUDA_CHUNK_TOKENS = 1 << 28

_F64 = torch.float64
_F32 = torch.float32


def _seg(x: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    return segment_sum(x, ids, n)


def _plan(gid, correct, num_groups, length, chunk_tokens):
    """Row order (group-major, correct rows first inside each chunk) and the chunks' bounds.

    Returns ``(order [B], lseg [B] local (polarity, group) id in sorted order, lgrp [B] local group id in sorted
    order, chunks: list of (r0, r1, n_groups, n_correct))``.
    """
    device = gid.device
    counts = torch.bincount(gid, minlength=num_groups)
    rows_per_chunk = max(1, chunk_tokens // max(length, 1))
    cum = counts.cumsum(0)
    chunk_of_group = torch.div(cum - 1, rows_per_chunk, rounding_mode="floor").clamp(min=0)
    _, cid, groups_per_chunk = torch.unique_consecutive(chunk_of_group, return_inverse=True, return_counts=True)
    n_chunks = int(groups_per_chunk.numel())
    g_end = groups_per_chunk.cumsum(0)
    g0 = g_end - groups_per_chunk
    neg = (~correct).to(torch.long)
    row_cid = cid[gid]
    key = (row_cid * 2 + neg) * num_groups + gid
    order = torch.argsort(key, stable=True)
    rows_in_chunk = torch.bincount(row_cid, minlength=n_chunks)
    pos_in_chunk = torch.bincount(row_cid[correct], minlength=n_chunks)
    s_cid = row_cid[order]
    s_gid = gid[order]
    lgrp = s_gid - g0[s_cid]
    lseg = neg[order] * groups_per_chunk[s_cid] + lgrp
    r_end = rows_in_chunk.cumsum(0)
    chunks = list(
        zip(
            (r_end - rows_in_chunk).tolist(),
            r_end.tolist(),
            groups_per_chunk.tolist(),
            pos_in_chunk.tolist(),
        )
    )
    return order.to(device), lseg, lgrp, chunks


class _Checker:
    """Chunk-wise entropy / mask checks; defers to the full check (which raises) when a chunk looks wrong."""

    def __init__(self, entropy, response_mask, tol):
        self.entropy, self.mask, self.tol = entropy, response_mask, tol
        self.mask_is_bool = response_mask.dtype == torch.bool

    def fail(self):
        from gtpo.algorithms.entropy_shaping import _check_token_values

        _check_token_values(self.entropy, self.mask, self.tol)
        raise ValueError("entropy / response_mask failed a consistency check")  # pragma: no cover

    def masked_entropy(self, h, mf, lens, inplace=True):
        """``h`` masked to the valid tokens (in place if ``inplace``), negatives within tolerance clamped to 0.

        Returns ``(hm, hsum, clamped)``: ``hsum`` the row sums before clamping (the reference's entropy
        diagnostics), ``clamped`` whether any negative value was clamped.
        """
        if h.numel() == 0:
            return h, h.sum(-1), False
        checks = [*torch.aminmax(h)]
        if not self.mask_is_bool:
            checks += [*torch.aminmax(mf), (torch.linalg.vecdot(mf, mf) - lens).abs().max()]
        vals = torch.stack(checks).tolist()
        if not self.mask_is_bool and not (vals[2] >= 0.0 and vals[3] <= 1.0 and vals[4] == 0.0):
            self.fail()
        if vals[0] >= 0.0 and math.isfinite(vals[1]):
            hm = h.mul_(mf) if inplace else h * mf
            return hm, hm.sum(-1), False
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


def _finish_rows(adv, mf, beta, gamma, lam_rows):
    """``adv = beta * z + gamma * m`` in place (times the conflict weights); row diagnostics of the result."""
    adv.mul_(beta.to(_F32)[:, None])
    if bool((gamma != 0).any()):
        adv.addcmul_(mf, gamma.to(_F32)[:, None])
    if lam_rows is not None:
        adv.mul_(lam_rows)
    sg = torch.sign(adv)
    sadv = adv.sum(-1)
    sp = sg.sum(-1)
    l1 = torch.linalg.vecdot(adv, sg)
    sa = sg.abs_().sum(-1)
    return torch.stack([sadv, l1, sp, sa], 1).to(_F64)


def _scales(st, set_ids, n_sets, a1, a2, unbiased, eps, rtol):
    """Per-row ``(beta, gamma)`` from per-row sums; ``st`` holds float64 [R] columns (see ``gtpo_fast``)."""
    lens, base, sgn, sw, k, ssq, absr = (st[n] for n in ("lens", "base", "sign", "sw", "k", "ssq", "absr"))
    n = _seg(lens, set_ids, n_sets)
    mean = _seg(a1 * base * lens + sgn * a2 * sw, set_ids, n_sets) / n.clamp(min=1)
    e = a1 * base + sgn * a2 * k - mean[set_ids]
    sz = sw - k * lens
    ss = a2 * a2 * ssq + 2.0 * sgn * a2 * e * sz + e * e * lens
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    std = (_seg(ss, set_ids, n_sets).clamp(min=0) / denom).sqrt()
    std = torch.where(n > 1, std, torch.zeros_like(std))
    abs_mean = _seg(absr, set_ids, n_sets) / n.clamp(min=1)
    constant = (n <= 1) | (std <= rtol * abs_mean)
    inv = torch.where(constant, torch.zeros_like(std), 1.0 / (std + eps))[set_ids]
    return sgn * a2 * inv, e * inv


@torch.no_grad()
def gtpo_fast(entropy, response_mask, rewards, gid, num_groups, params, reward_offset=None, responses=None):
    """Same contract as :func:`gtpo.algorithms.entropy_shaping.gtpo_token_advantages` (inputs already validated
    except for their ``[B, L]`` values)."""
    from gtpo.algorithms.entropy_shaping import _bases, _conflict_lambda

    device = entropy.device
    b, length = entropy.shape
    mask = response_mask.to(device)
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.detach().to(device)
    correct = rewards > params.reward_threshold
    off = None if reward_offset is None else reward_offset.to(device)
    base = _bases(rewards, correct, params.negative_base, off).to(_F64)
    sign = torch.where(correct, 1.0, -1.0).to(_F64)
    a1, a2, eps = float(params.alpha1), float(params.alpha2), float(params.eps)
    rtol = float(params.zero_var_rtol)
    unbiased = params.std == "unbiased"
    split = params.norm_mode == "split"
    group_scope = params.norm_scope == "group"
    checker = _Checker(entropy, mask, float(params.neg_entropy_tol))

    diag: dict[str, float] = {}
    lam = None
    if params.conflict_mask:
        lam, diag["conflict_token_frac"] = _conflict_lambda(responses, mask.bool(), correct, gid, num_groups, params)
        lam = lam.to(device=device, dtype=_F32)

    chunk_tokens = CUDA_CHUNK_TOKENS if device.type == "cuda" else CPU_CHUNK_TOKENS
    order, lseg_all, lgrp_all, chunks = _plan(gid, correct, num_groups, length, chunk_tokens)
    out = torch.empty((b, length), dtype=_F32, device=device)
    names = ("lens", "hsum", "sw", "wmax", "k", "ssq", "absr")
    rs = {n: torch.zeros(b, dtype=_F64, device=device) for n in names}  # per-row sums, original row order
    rdiag = torch.zeros((b, 4), dtype=_F64, device=device)  # sum adv, sum |adv|, sum sign, #nonzero
    cmax = torch.zeros((), dtype=_F32, device=device)

    for r0, r1, ngc, npos in chunks:
        if r1 == r0:
            continue
        rows = order[r0:r1]
        lseg = lseg_all[r0:r1]
        h = entropy.index_select(0, rows)
        h = h if h.dtype == _F32 else h.to(_F32)
        mk = mask.index_select(0, rows)
        mf = mk if mk.dtype == _F32 else mk.to(_F32)
        lens = mf.sum(-1)
        val, hsum, _ = checker.masked_entropy(h, mf, lens)
        # Eq. 5 weighs incorrect tokens by 1/(H + eps); padding stays 0 (the mask is the numerator)
        if npos < r1 - r0:
            vn = val[npos:]
            torch.div(mf[npos:], vn.add_(eps), out=vn)
        sums = torch.zeros((2 * ngc, length), dtype=_F32, device=device).index_add_(0, lseg, val)
        cnt = torch.zeros((2 * ngc, length), dtype=_F32, device=device).index_add_(0, lseg, mf)
        coef = cnt.div_(sums.add_(eps))  # d_t / (sum + eps): share * count = val * coef
        cmax = torch.maximum(cmax, coef.max())
        cg = coef.index_select(0, lseg)
        w = val.mul_(cg)
        sw = w.sum(-1).to(_F64)
        wmax = w.amax(-1).to(_F64)
        lens64 = lens.to(_F64)
        bc, sc = base[rows], sign[rows]
        # per-row centre k_i: the w at which the shaped reward equals its set's mean (chunk-local sets)
        if group_scope:
            set_ids, n_sets = (lseg, 2 * ngc) if split else (lgrp_all[r0:r1], ngc)
        else:
            set_ids = (lseg >= ngc).to(torch.long) if split else torch.zeros_like(lseg)
            n_sets = 2 if split else 1
        if a2 > 0:
            n_set = _seg(lens64, set_ids, n_sets)
            m_set = _seg(a1 * bc * lens64 + sc * a2 * sw, set_ids, n_sets) / n_set.clamp(min=1)
            k = ((m_set[set_ids] - a1 * bc) / (sc * a2)).to(_F32)
        else:
            k = torch.zeros(r1 - r0, dtype=_F32, device=device)
        z = torch.addcmul(w, mf, k[:, None], value=-1.0, out=cg)
        ssq = torch.linalg.vecdot(z, z).to(_F64)
        absr = (a1 * bc * lens64 + sc * a2 * sw).abs()
        mixed = (a1 * bc * sc < 0) & (lens64 > 0)
        if bool(mixed.any()):
            idx = torch.nonzero(mixed, as_tuple=True)[0]
            xs = w[idx] * (sc[idx] * a2).to(_F32)[:, None] + (a1 * bc[idx]).to(_F32)[:, None]
            absr[idx] = (xs.mul_(mf[idx])).abs_().sum(-1).to(_F64)
        st = {"lens": lens64, "hsum": hsum.to(_F64), "sw": sw, "wmax": wmax, "k": k.to(_F64), "ssq": ssq, "absr": absr}
        for n in names:
            rs[n][rows] = st[n]
        if group_scope:
            st.update(base=bc, sign=sc)
            beta, gamma = _scales(st, set_ids, n_sets, a1, a2, unbiased, eps, rtol)
            lam_rows = None if lam is None else lam.index_select(0, rows)
            rdiag[rows] = _finish_rows(z, mf, beta, gamma, lam_rows)
            out.index_copy_(0, rows, z)
        else:
            out.index_copy_(0, rows, z)

    if not group_scope:
        set_ids = (~correct).to(torch.long) if split else torch.zeros_like(gid)
        n_sets = 2 if split else 1
        beta, gamma = _scales({**rs, "base": base, "sign": sign}, set_ids, n_sets, a1, a2, unbiased, eps, rtol)
        step = max(1, chunk_tokens // max(length, 1))
        for r0 in range(0, b, step):
            r1 = min(b, r0 + step)
            mk = mask[r0:r1]
            mf = mk if mk.dtype == _F32 else mk.to(_F32)
            lam_rows = None if lam is None else lam[r0:r1]
            rdiag[r0:r1] = _finish_rows(out[r0:r1], mf, beta[r0:r1], gamma[r0:r1], lam_rows)

    diag.update(_diagnostics(rs, rdiag, correct, gid, num_groups, base, sign, a1, a2, eps, float(cmax)))
    return out, diag


def _diagnostics(rs, rdiag, correct, gid, num_groups, base, sign, a1, a2, eps, cmax):
    """The reference's diagnostics (``_gtpo_diagnostics``) from per-row sums."""
    from gtpo.algorithms.entropy_shaping import _gtpo_diagnostics_from_rows

    lens, hsum, sw, wmax, k, ssq = (rs[n] for n in ("lens", "hsum", "sw", "wmax", "k", "ssq"))
    sadv, l1, sp, sa = rdiag.unbind(1)
    sz = sw - k * lens
    w2 = ssq + 2.0 * k * sz + k * k * lens  # sum of w^2 over the valid tokens
    if a2 <= 0:
        sw, w2, wmax = torch.zeros_like(sw), torch.zeros_like(w2), torch.zeros_like(wmax)
    return _gtpo_diagnostics_from_rows(
        correct,
        gid,
        num_groups,
        lens,
        w_row=sw,
        w2_row=w2,
        w_max=wmax,
        shaped_row=a1 * base * lens + sign * a2 * rs["sw"],
        adv_row=sadv,
        abs_row=l1,
        pos_row=(l1 + sadv) / 2,
        neg_row=(sadv - l1) / 2,
        npos_row=(sa + sp) / 2,
        nneg_row=(sa - sp) / 2,
        ent_row=hsum,
        # exact for the computed rewards: sum_k share_k * count = count * (1 - eps / (sum + eps)), so the
        # largest deviation over groups and positions is a2 * eps * max(count / (sum + eps))
        conservation_err=a2 * eps * cmax,
    )


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
    checker = _Checker(entropy, mask, float(neg_entropy_tol))
    hsum = torch.zeros(b, dtype=_F64, device=device)
    lens = torch.zeros(b, dtype=_F64, device=device)
    step = max(1, (CUDA_CHUNK_TOKENS if device.type == "cuda" else CPU_CHUNK_TOKENS) // max(length, 1))
    for r0 in range(0, b, step):
        r1 = min(b, r0 + step)
        h = entropy[r0:r1].detach()
        own = h.dtype != _F32
        h = h.to(_F32) if own else h
        mk = mask[r0:r1]
        mf = mk if mk.dtype == _F32 else mk.to(_F32)
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
    step = max(1, (CUDA_CHUNK_TOKENS if mask.device.type == "cuda" else CPU_CHUNK_TOKENS) // max(length, 1))
    for r0 in range(0, b, step):
        r1 = min(b, r0 + step)
        torch.mul(mask[r0:r1].to(_F32), v[r0:r1], out=out[r0:r1])
    return out
