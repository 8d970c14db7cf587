"""The GTPO-token estimator: Eq. 3, 5, 6 of Tan et al., arXiv 2508.04349 (docs/ALGORITHMS.md §3).

:func:`gtpo_token_advantages` evaluates the shaped token rewards of :mod:`gtpo.algorithms.entropy_weights` and the
normalisation of :mod:`gtpo.algorithms.token_norm` without materialising either in float64:

- ``norm_scope = weight_scope = "batch"`` (the defaults, paper §2.2 and §4): closed forms in per-position sums, two
  passes over ``[B, L]`` (:mod:`gtpo.algorithms.gtpo_closed_form`). The other combinations run chunk by chunk:
- ``weight_scope="batch"`` with ``norm_scope="group"``: one chunked pass over the rows first sums ``H`` over the
  batch's correct tokens, ``1/(H+eps)`` over its incorrect tokens and the counts, per position (the denominators of
  Eq. 3 / Eq. 5 and ``d_t`` / ``h_t``). ``"group"``: rows are ordered by group and processed in chunks of whole
  groups, the correct rows of a chunk first, so each group's per-position sums are complete inside its chunk.
- Token arithmetic is float32; every mean, variance and sum over rows or sets is float64 over per-row partial sums
  (:func:`gtpo.algorithms.token_norm.set_scales`). Each row's sum of squares is centred at ``k_i``, the weight at
  which its shaped reward equals its set's mean (chunk-local estimate), so near-constant sets are measured to
  float32 resolution, which the zero-variance rule needs. The advantage of a valid token is
  ``beta_i * (w - k_i) + gamma_i``.
- ``norm_scope="batch"`` with ``weight_scope="group"`` combines the per-row sums of all chunks exactly in float64,
  then rescales the stored rows in a last chunked pass; ``norm_scope="group"`` finishes each chunk at once.
- ``conflict_mask`` multiplies the final advantages by GTPO-trajectory's conflict weights (arXiv 2508.03772, §6.2),
  polarity = correctness.

Choices where the paper is silent are listed in :mod:`gtpo.algorithms.entropy_shaping`.
"""

from __future__ import annotations

import torch

from gtpo.algorithms.chunked_rows import TokenChecker, chunk_rows, chunk_tokens, float32_chunk
from gtpo.algorithms.entropy_shaping import GTPOParams, shaping_bases, validate_with_params
from gtpo.algorithms.group_ops import segment_sum
from gtpo.algorithms.gtpo_closed_form import gtpo_batch_closed_form
from gtpo.algorithms.shaping_diagnostics import advantage_row_sums, gtpo_diagnostics_from_rows
from gtpo.algorithms.token_norm import set_layout, set_scales, zero_counts

__all__ = ["gtpo_token_advantages"]

_F64 = torch.float64
_F32 = torch.float32


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
        params: :class:`GTPOParams` (None: the defaults).
        reward_offset: optional ``[B]`` additive reward (e.g. the GROP penalty), added to both bases.
        responses: ``[B, L]`` token ids; required when ``params.conflict_mask``.

    Returns:
        ``(advantages, diagnostics)``: advantages ``[B, L]`` float32, zero on padding; diagnostics a dict of python
        floats (:func:`gtpo.algorithms.shaping_diagnostics.gtpo_diagnostics_from_rows`, plus
        ``conflict_token_frac`` under ``conflict_mask``).

    Raises:
        ValueError: on bad inputs (see :func:`gtpo.algorithms.entropy_shaping.validate_shaping_inputs`) or a
            missing ``responses``.
    """
    params = params or GTPOParams()
    validate_with_params(params, entropy, response_mask, rewards, gid, num_groups, reward_offset, check_tokens=False)
    if params.conflict_mask:
        check_responses(responses, response_mask)
    return _gtpo_chunked(entropy, response_mask, rewards, gid, num_groups, params, reward_offset, responses)


def check_responses(responses, response_mask: torch.Tensor) -> None:
    if responses is None:
        raise ValueError("conflict_mask=True needs the response token ids (responses), got None")
    if not isinstance(responses, torch.Tensor) or tuple(responses.shape) != tuple(response_mask.shape):
        got = tuple(responses.shape) if isinstance(responses, torch.Tensor) else type(responses).__name__
        raise ValueError(f"responses shape {got} does not match response_mask {tuple(response_mask.shape)}")


def _conflict_lambda(responses, valid, correct, gid, num_groups, params) -> tuple[torch.Tensor, float]:
    """GTPO's ``conflict_mask`` option: GTPO-trajectory's conflict weights with correctness as the polarity.

    Args:
        responses: ``[B, L]`` token ids. valid: ``[B, L]`` bool mask (its device is used). correct: ``[B]`` bool.
        gid: ``[B]`` int64 group ids; num_groups: ``NG``. params: :class:`GTPOParams` (``conflict_lam_pos/neg``).

    Returns:
        ``(lam [B, L] float32, conflict_token_frac)``: ``lam`` multiplies the advantages (0 on padding); the
        fraction counts conflict tokens over the valid tokens. Empty responses take no part (polarity 0).
    """
    from gtpo.algorithms.trajectory import conflict_weights

    polarity = torch.where(correct, 1, -1).to(torch.int8) * valid.any(-1).to(torch.int8)
    lam, is_conflict = conflict_weights(
        responses.to(valid.device),
        valid,
        gid,
        num_groups,
        polarity,
        float(params.conflict_lam_pos),
        float(params.conflict_lam_neg),
    )
    return lam, float(is_conflict.sum()) / max(int(valid.sum()), 1)


def _plan(gid, correct, num_groups, length, tokens_per_chunk):
    """Row order (group-major, correct rows first inside each chunk) and the chunks' bounds.

    Returns ``(order [B], lseg [B] local (polarity, group) id in sorted order, lgrp [B] local group id in sorted
    order, chunks: list of (r0, r1, n_groups, n_correct))``.
    """
    device = gid.device
    counts = torch.bincount(gid, minlength=num_groups)
    rows_per_chunk = max(1, tokens_per_chunk // max(length, 1))
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


def _finish_rows(adv, mf, beta, gamma, lam_rows):
    """``adv = beta * z + gamma * m`` in place (times the conflict weights); row diagnostics of the result."""
    adv.mul_(beta.to(_F32)[:, None])
    if bool((gamma != 0).any()):
        adv.addcmul_(mf, gamma.to(_F32)[:, None])
    if lam_rows is not None:
        adv.mul_(lam_rows)
    return advantage_row_sums(adv)


def _batch_coefficients(entropy, mask, correct, eps, checker, device):
    """``weight_scope="batch"``: ``[2, L]`` float32 ``count / (sum + eps)`` per polarity and position.

    Row 0: ``d_t / (sum_{O+_t} H + eps)`` over the batch's correct rows; row 1: ``h_t / (sum_{O-_t} 1/(H+eps) + eps)``
    over its incorrect rows. One chunked pass over contiguous rows; sums accumulate in float64 across chunks.
    """
    b, length = entropy.shape
    sums = torch.zeros((2, length), dtype=_F64, device=device)
    cnt = torch.zeros((2, length), dtype=_F64, device=device)
    pol = (~correct).to(torch.long)
    step = chunk_rows(device, length)
    for r0 in range(0, b, step):
        r1 = min(b, r0 + step)
        h, own, mf = float32_chunk(entropy, mask, r0, r1)
        val, _, _ = checker.masked_entropy(h, mf, mf.sum(-1), inplace=own)
        neg = ~correct[r0:r1]
        if bool(neg.any()):
            val = torch.where(neg[:, None], mf / (val + eps), val)
        pr = pol[r0:r1]
        sums += torch.zeros((2, length), dtype=_F32, device=device).index_add_(0, pr, val).to(_F64)
        cnt += torch.zeros((2, length), dtype=_F32, device=device).index_add_(0, pr, mf).to(_F64)
    return (cnt / (sums + eps)).to(_F32)


def _gtpo_chunked(entropy, response_mask, rewards, gid, num_groups, params, reward_offset, responses):
    """:func:`gtpo_token_advantages` on validated inputs (the ``[B, L]`` values are checked chunk by chunk)."""
    device = entropy.device
    b, length = entropy.shape
    mask = response_mask.to(device)
    gid = gid.to(device=device, dtype=torch.long)
    rewards = rewards.detach().to(device)
    correct = rewards > params.reward_threshold
    off = None if reward_offset is None else reward_offset.to(device)
    base = shaping_bases(rewards, correct, params.negative_base, off).to(_F64)
    sign = torch.where(correct, 1.0, -1.0).to(_F64)
    a1, a2, eps = float(params.alpha1), float(params.alpha2), float(params.eps)
    rtol = float(params.zero_var_rtol)
    unbiased = params.std == "unbiased"
    mode = params.norm_mode
    group_scope = params.norm_scope == "group"
    checker = TokenChecker(entropy, mask, float(params.neg_entropy_tol))

    diag: dict[str, float] = {}
    lam = None
    if params.conflict_mask:
        lam, diag["conflict_token_frac"] = _conflict_lambda(responses, mask.bool(), correct, gid, num_groups, params)
        lam = lam.to(device=device, dtype=_F32)

    names = ("lens", "hsum", "sw", "wmax", "k", "ssq", "absr")
    rs = {n: torch.zeros(b, dtype=_F64, device=device) for n in names}  # per-row sums, original row order
    rdiag = torch.zeros((b, 4), dtype=_F64, device=device)  # sum adv, sum |adv|, sum sign, #nonzero
    if b == 0 or length == 0 or num_groups == 0:
        out = torch.zeros((b, length), dtype=_F32, device=device)
        diag.update(_diagnostics(rs, rdiag, correct, gid, num_groups, base, sign, a1, a2, eps, 0.0))
        return out, diag
    if params.weight_scope == "batch" and not group_scope:
        adv, closed_diag = gtpo_batch_closed_form(entropy, mask, correct, base, gid, num_groups, lam, params, checker)
        diag.update(closed_diag)
        return adv, diag
    batch_coef = None
    if params.weight_scope == "batch":
        batch_coef = _batch_coefficients(entropy, mask, correct, eps, checker, device)
    cmax = torch.zeros((), dtype=_F32, device=device) if batch_coef is None else batch_coef.max()

    tokens = chunk_tokens(device)
    order, lseg_all, lgrp_all, chunks = _plan(gid, correct, num_groups, length, tokens)
    out = torch.empty((b, length), dtype=_F32, device=device)

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
        if batch_coef is None:
            sums = torch.zeros((2 * ngc, length), dtype=_F32, device=device).index_add_(0, lseg, val)
            cnt = torch.zeros((2 * ngc, length), dtype=_F32, device=device).index_add_(0, lseg, mf)
            coef = cnt.div_(sums.add_(eps))  # d_t / (sum + eps): share * count = val * coef
            cmax = torch.maximum(cmax, coef.max())
            cg = coef.index_select(0, lseg)
        else:
            cg = batch_coef.index_select(0, (lseg >= ngc).to(torch.long))
        w = val.mul_(cg)
        sw = w.sum(-1).to(_F64)
        wmax = w.amax(-1).to(_F64)
        lens64 = lens.to(_F64)
        bc, sc = base[rows], sign[rows]
        # per-row centre k_i: the w at which the shaped reward equals its set's mean (chunk-local sets)
        pol_local = (lseg >= ngc).to(torch.long)
        if group_scope:
            set_ids, n_sets = set_layout(mode, lseg, lgrp_all[r0:r1], ngc)
        else:
            set_ids, n_sets = set_layout(mode, pol_local, torch.zeros_like(lseg), 1)
        n_set = segment_sum(lens64, set_ids, n_sets)
        zeros_local = zero_counts(mode, n_set)
        if a2 > 0:
            n_all = n_set if zeros_local is None else n_set + zeros_local
            m_set = segment_sum(a1 * bc * lens64 + sc * a2 * sw, set_ids, n_sets) / n_all.clamp(min=1)
            k = ((m_set[set_ids] - a1 * bc) / (sc * a2)).to(_F32)
        else:
            k = torch.zeros(r1 - r0, dtype=_F32, device=device)
        z = torch.addcmul(w, mf, k[:, None], value=-1.0, out=cg if batch_coef is None else None)
        ssq = torch.linalg.vecdot(z, z).to(_F64)
        absr = (a1 * bc * lens64 + sc * a2 * sw).abs()
        # rows whose shaped rewards change sign (a base of the other sign than the entropy term) need |x| per token
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
            beta, gamma = set_scales(st, set_ids, n_sets, a1, a2, unbiased, eps, rtol, zeros_local)
            lam_rows = None if lam is None else lam.index_select(0, rows)
            rdiag[rows] = _finish_rows(z, mf, beta, gamma, lam_rows)
        out.index_copy_(0, rows, z)

    if not group_scope:
        pol = (~correct).to(torch.long)
        set_ids, n_sets = set_layout(mode, pol, torch.zeros_like(pol), 1)
        n_zeros = zero_counts(mode, segment_sum(rs["lens"], set_ids, n_sets))
        st = {**rs, "base": base, "sign": sign}
        beta, gamma = set_scales(st, set_ids, n_sets, a1, a2, unbiased, eps, rtol, n_zeros)
        step = chunk_rows(device, length)
        for r0 in range(0, b, step):
            r1 = min(b, r0 + step)
            mk = mask[r0:r1]
            mf = mk if mk.dtype == _F32 else mk.to(_F32)
            lam_rows = None if lam is None else lam[r0:r1]
            rdiag[r0:r1] = _finish_rows(out[r0:r1], mf, beta[r0:r1], gamma[r0:r1], lam_rows)

    diag.update(_diagnostics(rs, rdiag, correct, gid, num_groups, base, sign, a1, a2, eps, float(cmax)))
    return out, diag


def _diagnostics(rs, rdiag, correct, gid, num_groups, base, sign, a1, a2, eps, cmax):
    """:func:`gtpo.algorithms.shaping_diagnostics.gtpo_diagnostics_from_rows` from the chunked per-row sums."""

    lens, hsum, sw, wmax, k, ssq = (rs[n] for n in ("lens", "hsum", "sw", "wmax", "k", "ssq"))
    sadv, l1, sp, sa = rdiag.unbind(1)
    sz = sw - k * lens
    w2 = ssq + 2.0 * k * sz + k * k * lens  # sum of w^2 over the valid tokens
    if a2 <= 0:
        sw, w2, wmax = torch.zeros_like(sw), torch.zeros_like(w2), torch.zeros_like(wmax)
    return gtpo_diagnostics_from_rows(
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
        # largest deviation over weight segments and positions is a2 * eps * max(count / (sum + eps))
        conservation_err=a2 * eps * cmax,
    )
