"""GTPO advantages in closed form at batch scope (Tan et al., arXiv 2508.04349, Eq. 3, 5, 6; paper §2.2, §4).

The recipe's default, ``norm_scope="batch"`` with ``weight_scope="batch"``: the entropy shares of Eq. 3 / Eq. 5 and
the Eq. 6 statistics all run over the whole batch, per polarity. Every set statistic then has a closed form in
per-position sums, so two passes over ``[B, L]`` suffice: one read of the entropy for the sums and one fused
read-and-write for the advantages (plus their diagnostics). The equations, knobs, edge cases and diagnostics are
those of :func:`gtpo.algorithms.gtpo_token.gtpo_token_advantages`; only the evaluation order differs.

Per polarity q (correct rows: ``v = H``, sign ``s = +1``; incorrect rows: ``v = 1/(H+eps)``, ``s = -1``), with
``c_t = cnt_t / (S_t + eps)`` and ``S_t = sum_i v_{i,t}`` over the polarity's rows active at ``t``, the shaped
reward is ``x = a1*b_i + s*a2*c_t*v``. Writing ``v = vbar_t + (v - vbar_t)`` and ``b = bbar_t + (b - bbar_t)``
per position, the polarity's centred second moment is

    M2_q = sum_t [a1^2 Vb_t + a2^2 c_t^2 Vv_t + 2 s a1 a2 c_t C_t + cnt_t (a1 bbar_t + s a2 c_t vbar_t - mu_q)^2]

with ``Vv_t``, ``Vb_t``, ``C_t`` the per-position centred (co)variances of ``v`` and the bases. They are
accumulated from sums shifted by a per-position pilot (the first chunk's column means) and a per-polarity pilot
base, so near-constant sets are measured to float32 resolution rather than to cancellation noise, which the
zero-variance rule needs. ``split``, ``joint`` and ``zero_fill`` sets combine ``(N_q, mu_q, M2_q)`` exactly
(zero_fill: the other polarity's tokens enter as zeros). ``mean|x|`` is ``|sum x|`` for sign-consistent rows and is
read token by token for the rare rows whose shaped rewards change sign (a base of the other sign than ``s``).

``compiled_kernels=True`` runs each chunk of both passes as one :func:`torch.compile` kernel (gather, checks, Eq. 5,
shift and all reductions fused; the first chunk of each polarity, which sets the pilots, and conflict-weighted
chunks stay eager); the eager code is the fallback and the kernels are tested against it.

The advantage of a valid token is ``beta_t * (v - p_t) + g_t + rho_i`` (``beta_t = s*a2*c_t/(std+eps)``,
``g_t`` the pilot's own advantage, ``rho_i = a1*(b_i - pilot base)/(std+eps)``): the large terms cancel in float64,
not in float32.
"""

from __future__ import annotations

import math
import warnings

import torch

from gtpo.algorithms.chunked_rows import chunk_rows
from gtpo.algorithms.shaping_diagnostics import advantage_row_sums, gtpo_diagnostics_from_rows

__all__ = ["gtpo_batch_closed_form"]

_F64 = torch.float64
_F32 = torch.float32


def _rows_f32(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = x.index_select(0, rows)
    return out if out.dtype == _F32 else out.to(_F32)


def _values(checker, entropy, mask, rows, negative, eps, checked=False):
    """``(v [R, L] float32 (0 on padding), mf [R, L], lens [R], hsum [R])`` of one polarity-homogeneous chunk.

    ``checked``: the rows were checked in the first pass (the second pass does not repeat the checks).
    """
    h = _rows_f32(entropy, rows)
    mf = _rows_f32(mask, rows)
    lens = mf.sum(-1)
    v, hsum, _ = checker.masked_entropy(h, mf, lens, checked=checked)  # hsum before clamping, as the reference
    if negative:
        torch.div(mf, v.add_(eps), out=v)  # Eq. 5: 1/(H + eps) on valid tokens, 0 on padding
    return v, mf, lens, hsum


def _sum_kernel(entropy, mask, rows, pilot, e, negative: bool, eps: float):
    """Pass 1 of one chunk as a pure function (the body :func:`torch.compile` fuses; ``compiled_kernels``).

    Returns the per-position sums of :class:`_PolaritySums` for this chunk (float32), the row sums
    ``lens`` / ``hsum`` and the check values ``(h_lo, h_hi, m_lo, m_hi, m_nonbinary)`` over the chunk.
    """
    h = entropy.index_select(0, rows).to(torch.float32)
    m = mask.index_select(0, rows).to(torch.float32)
    hv = torch.where(m != 0, h, torch.zeros_like(h))
    checks = torch.stack([hv.amin(), hv.amax(), m.amin(), m.amax(), (m - m * m).sum()])
    hsum = hv.sum(-1)
    hm = hv.clamp_min(0.0)
    v = m / (hm + eps) if negative else hm
    u = v - m * pilot[None, :]
    em = e[:, None] * m
    cols = torch.stack([m.sum(0), u.sum(0), (u * u).sum(0), em.sum(0), (em * e[:, None]).sum(0), (em * u).sum(0)])
    return cols, v.amax(0), m.sum(-1), hsum, checks


def _write_kernel(entropy, mask, rows, pilot, beta_t, g_t, rho, negative: bool, eps: float):
    """Pass 2 of one chunk as a pure function: the advantages ``[R, L]`` and their row sums (``compiled_kernels``)."""
    h = entropy.index_select(0, rows).to(torch.float32)
    m = mask.index_select(0, rows).to(torch.float32)
    hm = torch.where(m != 0, h, torch.zeros_like(h)).clamp_min(0.0)
    v = m / (hm + eps) if negative else hm
    z = (v - m * pilot[None, :]) * beta_t[None, :] + m * (g_t[None, :] + rho[:, None])
    sg = torch.sign(z)
    return z, torch.stack([z.sum(-1), (z * sg).sum(-1), sg.sum(-1), sg.abs().sum(-1)], 1)


_COMPILED: dict = {}


def _run_fused(fn, *args):
    """``torch.compile(fn, dynamic=True)`` (built once per process) on ``args``, or None when compilation is not
    available here (no C++ compiler, unsupported backend): then a warning is issued once and the eager code runs."""
    if _COMPILED.get("broken"):
        return None
    try:
        if fn.__name__ not in _COMPILED:
            _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
        return _COMPILED[fn.__name__](*args)
    except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the eager evaluation
        _COMPILED["broken"] = True
        warnings.warn(
            f"compiled_kernels: torch.compile failed ({type(err).__name__}: {err}); using the eager path", stacklevel=2
        )
        return None


class _PolaritySums:
    """Per-position sums of one polarity, shifted by pilots (see the module docstring)."""

    def __init__(self, length, base_pilot, device):
        z = lambda: torch.zeros(length, dtype=_F64, device=device)  # noqa: E731
        self.cnt, self.su, self.qu, self.se, self.qe, self.ceu = z(), z(), z(), z(), z(), z()
        self.vmax = torch.zeros(length, dtype=_F32, device=device)
        self.pilot = None
        self.base_pilot = base_pilot

    def add(self, v, mf, e):
        """``v`` (overwritten) and ``mf``: ``[R, L]`` float32; ``e``: ``[R]`` float32 base - pilot base, or None."""
        ones = torch.ones(v.shape[0], dtype=_F32, device=v.device)
        cnt = ones @ mf  # column sums as a matrix-vector product (faster than a dim-0 reduction on CPU)
        torch.maximum(self.vmax, v.amax(0), out=self.vmax)
        if self.pilot is None:
            col = ones @ v
            overall = col.sum() / cnt.sum().clamp(min=1)
            self.pilot = torch.where(cnt > 0, col / cnt.clamp(min=1), overall)
        u = v.addcmul_(mf, self.pilot[None, :], value=-1.0)  # in place: v is not needed afterwards
        self.cnt += cnt.to(_F64)
        self.su += (ones @ u).to(_F64)
        if e is not None:
            self.se += (e @ mf).to(_F64)
            self.qe += ((e * e) @ mf).to(_F64)
            self.ceu += (e @ u).to(_F64)
        self.qu += (ones @ u.mul_(u)).to(_F64)

    def add_columns(self, cols, vmax):
        """Fold one chunk's :func:`_sum_kernel` columns in (the pilot must already be set)."""
        cols = cols.to(_F64)
        self.cnt += cols[0]
        self.su += cols[1]
        self.qu += cols[2]
        self.se += cols[3]
        self.qe += cols[4]
        self.ceu += cols[5]
        torch.maximum(self.vmax, vmax, out=self.vmax)

    def moments(self, a1, a2, s, eps):
        """Closed-form polarity statistics (float64): ``dict`` of [L] columns and the totals ``n``, ``x1``, ``m2``."""
        cnt = self.cnt
        d = cnt.clamp(min=1)
        pilot = self.pilot.to(_F64) if self.pilot is not None else torch.zeros_like(cnt)
        s_t = self.su + pilot * cnt  # sum of v
        c = cnt / (s_t + eps)
        vbar = s_t / d
        vv = (self.qu - self.su * self.su / d).clamp(min=0)
        bbar = self.base_pilot + self.se / d
        vb = (self.qe - self.se * self.se / d).clamp(min=0)
        cbv = self.ceu - self.se * self.su / d
        n = float(cnt.sum())
        x1 = float((a1 * bbar * cnt + s * a2 * c * s_t).sum())
        mu = x1 / n if n > 0 else 0.0
        g = a1 * bbar + s * a2 * c * vbar - mu
        m2 = float((a1 * a1 * vb + a2 * a2 * c * c * vv + 2.0 * s * a1 * a2 * c * cbv + cnt * g * g).sum())
        w2 = float((c * c * (vv + cnt * vbar * vbar)).sum())  # sum of w^2 over the polarity's tokens
        return {"c": c, "pilot": pilot, "n": n, "x1": x1, "m2": max(m2, 0.0), "sw": float((c * s_t).sum()), "w2": w2}


def _set_stats(mode, st, n_tok):
    """``{q: (mean, m2, n)}`` of the set each polarity reads its advantages from."""
    (np_, xp, mp), (nn, xn, mn) = ((st[q]["n"], st[q]["x1"], st[q]["m2"]) for q in (0, 1))
    mu = [xp / np_ if np_ else 0.0, xn / nn if nn else 0.0]
    if mode == "split":
        return {0: (mu[0], mp, np_), 1: (mu[1], mn, nn)}
    if mode == "joint":
        m = (xp + xn) / n_tok if n_tok else 0.0
        m2 = mp + mn + np_ * (mu[0] - m) ** 2 + nn * (mu[1] - m) ** 2
        return {0: (m, m2, n_tok), 1: (m, m2, n_tok)}
    out = {}
    for q, (nq, xq, mq) in enumerate(((np_, xp, mp), (nn, xn, mn))):
        m = xq / n_tok if n_tok else 0.0
        out[q] = (m, mq + nq * (mu[q] - m) ** 2 + (n_tok - nq) * m * m, n_tok)
    return out


def gtpo_batch_closed_form(entropy, mask, correct, base, gid, num_groups, lam, params, checker):
    """GTPO advantages for ``norm_scope = weight_scope = "batch"`` (validated inputs, any ``norm_mode``).

    Args:
        entropy, mask: ``[B, L]`` (mask on entropy's device). correct: ``[B]`` bool. base: ``[B]`` float64 bases.
        gid: ``[B]`` int64 group ids, num_groups: ``NG`` (only the group-outcome diagnostics read them).
        lam: ``[B, L]`` float32 conflict weights or None. params: :class:`GTPOParams`. checker: ``TokenChecker``.

    Returns:
        ``(advantages [B, L] float32, diagnostics)``.
    """
    device = entropy.device
    b, length = entropy.shape
    a1, a2, eps = float(params.alpha1), float(params.alpha2), float(params.eps)
    step = chunk_rows(device, length)
    fused = bool(params.compiled_kernels)
    if fused:
        checker.dirty = True  # the kernels never look at padding; an eager fallback chunk must select, not multiply
    order = torch.argsort((~correct).to(torch.int8), stable=True)
    n_pos = int(correct.sum())
    spans = [(0, n_pos, 0), (n_pos, b, 1)]
    lens = torch.zeros(b, dtype=_F64, device=device)
    hsum = torch.zeros(b, dtype=_F64, device=device)

    sums = {}
    for lo, hi, q in spans:
        rows_q = order[lo:hi]
        bq = base[rows_q]
        pilot_base = float(bq[0]) if hi > lo else 0.0
        e_all = (bq - pilot_base).to(_F32)
        varying = bool((e_all != 0).any())
        sums[q] = _PolaritySums(length, pilot_base, device)
        for r0 in range(lo, hi, step):
            rows = order[r0 : min(hi, r0 + step)]
            e = e_all[r0 - lo : r0 - lo + rows.numel()]
            res = None
            if fused and sums[q].pilot is not None:
                res = _run_fused(_sum_kernel, entropy, mask, rows, sums[q].pilot, e, q == 1, eps)
            if res is not None:
                cols, vmax, ln, hs, checks = res
                h_lo, h_hi, m_lo, m_hi, m_bad = checks.tolist()
                if not (math.isfinite(h_lo) and math.isfinite(h_hi)) or h_lo < -checker.tol:
                    checker.fail()
                if not (m_lo >= 0.0 and m_hi <= 1.0 and m_bad == 0.0):
                    checker.fail()
                sums[q].add_columns(cols, vmax)
            else:
                v, mf, ln, hs = _values(checker, entropy, mask, rows, q == 1, eps)
                sums[q].add(v, mf, e if varying else None)
            lens[rows], hsum[rows] = ln.to(_F64), hs.to(_F64)
    st = {q: sums[q].moments(a1, a2, 1.0 if q == 0 else -1.0, eps) for q in (0, 1)}

    # mean|x| of each polarity's own tokens: |sum x| over its sign-consistent rows (s * x >= 0 there), token by
    # token over the rare rows whose shaped rewards change sign (a base of the other sign than s)
    sign = torch.where(correct, 1.0, -1.0).to(_F64)
    mixed = (a1 * base * sign < 0) & (lens > 0)
    absq = [abs(st[0]["x1"]), abs(st[1]["x1"])]
    if bool(mixed.any()):
        for q in (0, 1):
            rows = torch.nonzero(mixed & (correct if q == 0 else ~correct), as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            v, mf, _, _ = _values(checker, entropy, mask, rows, q == 1, eps, checked=True)
            s = 1.0 if q == 0 else -1.0
            x = (v * (s * a2 * st[q]["c"]).to(_F32)[None, :]).add_((a1 * base[rows]).to(_F32)[:, None]).mul_(mf)
            mixed_sum = float(x.sum(dtype=_F64))
            absq[q] = abs(st[q]["x1"] - mixed_sum) + float(x.abs().sum(dtype=_F64))
    n_tok = st[0]["n"] + st[1]["n"]
    sets = _set_stats(params.norm_mode, st, n_tok)

    out = torch.empty((b, length), dtype=_F32, device=device)
    rdiag = torch.zeros((b, 4), dtype=_F64, device=device)

    for lo, hi, q in spans:
        mean, m2, n = sets[q]
        denom = max(n - 1.0, 1.0) if params.std == "unbiased" else max(n, 1.0)
        std = (m2 / denom) ** 0.5 if n > 1 else 0.0
        # zero_fill's zeros add nothing to sum|x|; joint's set holds both polarities
        abs_sum = absq[0] + absq[1] if params.norm_mode == "joint" else absq[q]
        abs_mean = abs_sum / n if n else 0.0
        constant = n <= 1 or std <= params.zero_var_rtol * abs_mean
        inv = 0.0 if constant else 1.0 / (std + eps)
        s = 1.0 if q == 0 else -1.0
        c, pilot = st[q]["c"], st[q]["pilot"]
        beta_t = (s * a2 * inv * c).to(_F32)
        g_t = (inv * (a1 * sums[q].base_pilot + s * a2 * c * pilot - mean)).to(_F32)
        pilot32 = st[q]["pilot"].to(_F32)
        for r0 in range(lo, hi, step):
            rows = order[r0 : min(hi, r0 + step)]
            rho = (a1 * inv * (base[rows] - sums[q].base_pilot)).to(_F32)
            res = None
            if fused and lam is None:
                res = _run_fused(_write_kernel, entropy, mask, rows, pilot32, beta_t, g_t, rho, q == 1, eps)
            if res is not None:
                z, row_sums = res
                rdiag[rows] = row_sums.to(_F64)
                out.index_copy_(0, rows, z)
                continue
            v, mf, _, _ = _values(checker, entropy, mask, rows, q == 1, eps, checked=True)
            z = torch.addcmul(v, mf, pilot32[None, :], value=-1.0, out=v)
            z.mul_(beta_t[None, :]).addcmul_(mf, g_t[None, :])
            if bool((rho != 0).any()):
                z.addcmul_(mf, rho[:, None])
            if lam is not None:
                z.mul_(lam.index_select(0, rows))
            rdiag[rows] = advantage_row_sums(z)
            out.index_copy_(0, rows, z)

    # the weight and shaped-reward diagnostics are per-polarity totals: put each on one non-empty row of its polarity
    polarity_rows = {key: torch.zeros(b, dtype=_F64, device=device) for key in ("sw", "w2", "x1", "wmax")}
    for q in (0, 1):
        live = torch.nonzero((correct if q == 0 else ~correct) & (lens > 0), as_tuple=True)[0]
        if live.numel() == 0:
            continue
        row = live[0]
        for key in ("sw", "w2", "x1"):
            polarity_rows[key][row] = st[q][key]
        polarity_rows["wmax"][row] = float((st[q]["c"] * sums[q].vmax.to(_F64)).max())
    cmax = max(float(st[q]["c"].max()) if length else 0.0 for q in (0, 1))
    sadv, l1, sp, sa = rdiag.unbind(1)
    zero = torch.zeros_like(sadv)
    diag = gtpo_diagnostics_from_rows(
        correct,
        gid,
        num_groups,
        lens,
        w_row=polarity_rows["sw"] if a2 > 0 else zero,
        w2_row=polarity_rows["w2"] if a2 > 0 else zero,
        w_max=polarity_rows["wmax"] if a2 > 0 else zero,
        shaped_row=polarity_rows["x1"],
        adv_row=sadv,
        abs_row=l1,
        pos_row=(l1 + sadv) / 2,
        neg_row=(sadv - l1) / 2,
        npos_row=(sa + sp) / 2,
        nneg_row=(sa - sp) / 2,
        ent_row=hsum,
        conservation_err=a2 * eps * cmax,
    )
    return out, diag
