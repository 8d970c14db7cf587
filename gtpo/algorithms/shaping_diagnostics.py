"""Batch diagnostics of the entropy-shaped estimators (arXiv 2508.04349), from per-row sums.

Not an equation module: the ``gtpo/...`` and ``grpo_s/...`` metrics are built here from ``[B]`` row reductions so
that the estimators need no extra pass over ``[B, L]`` for them.
"""

from __future__ import annotations

import math

import torch

from gtpo.algorithms.group_ops import segment_sum

__all__ = ["masked_mean", "group_outcome_fracs", "advantage_row_sums", "gtpo_diagnostics_from_rows"]


def masked_mean(x: torch.Tensor, sel: torch.Tensor) -> float:
    n = int(sel.sum())
    return float(torch.where(sel, x, 0.0).sum()) / n if n else 0.0


def advantage_row_sums(adv: torch.Tensor) -> torch.Tensor:
    """``[R, 4]`` float64 per-row sums of ``adv [R, L]`` (0 on padding): sum, sum of ``|adv|``, sum of signs, and the
    number of non-zero entries (the inputs of :func:`gtpo_diagnostics_from_rows`' advantage keys)."""
    sg = torch.sign(adv)
    sadv = adv.sum(-1)
    sp = sg.sum(-1)
    l1 = torch.linalg.vecdot(adv, sg)
    sa = sg.abs_().sum(-1)
    return torch.stack([sadv, l1, sp, sa], 1).to(torch.float64)


def group_outcome_fracs(correct: torch.Tensor, nonempty: torch.Tensor, gid: torch.Tensor, num_groups: int):
    """Fractions of groups (with at least one non-empty response) that are all correct / all wrong."""
    n_rows = segment_sum(nonempty.to(torch.float64), gid, num_groups)
    n_pos = segment_sum((nonempty & correct).to(torch.float64), gid, num_groups)
    live = n_rows > 0
    n_live = int(live.sum())
    if n_live == 0:
        return 0.0, 0.0
    all_pos = float((live & (n_pos == n_rows)).sum()) / n_live
    all_neg = float((live & (n_pos == 0)).sum()) / n_live
    return all_pos, all_neg


def gtpo_diagnostics_from_rows(
    correct, gid, num_groups, lens, *, w_row, w2_row, w_max, shaped_row, adv_row, abs_row, pos_row, neg_row,
    npos_row, nneg_row, ent_row, conservation_err,
) -> dict[str, float]:  # fmt: skip
    """GTPO's diagnostics from ``[B]`` per-row sums over the valid tokens.

    Keys: ``weight_pos_mean/std/max`` and ``weight_neg_*`` (the count-scaled entropy weights ``share*d_t``, mean 1
    by construction; 0 when ``alpha2 = 0``), ``shaped_correct_mean`` / ``shaped_incorrect_mean`` (token means of the
    non-zero shaped reward), ``adv_correct_mean`` / ``adv_incorrect_mean`` (token means per polarity),
    ``adv_pos_mean`` / ``adv_neg_mean`` (mean of the positive / negative advantages), ``adv_abs_mean``,
    ``frac_tokens_adv_pos`` / ``frac_tokens_adv_neg``, ``conservation_err`` (max over weight segments and positions
    of ``|sum r~ - (a1*sum base +- a2*count)|``; ~``a2*eps/H`` unless all entropies at a position are 0),
    ``frac_groups_all_correct`` / ``frac_groups_all_wrong``, ``entropy_correct_mean`` / ``entropy_incorrect_mean``.

    ``lens`` token counts; ``w_row`` / ``w2_row`` / ``w_max`` sum, sum of squares and max of the count-scaled
    entropy weights (``w_max`` is read on non-empty rows only); ``shaped_row``, ``adv_row``, ``abs_row``,
    ``pos_row``, ``neg_row`` sums of the shaped rewards, advantages, their absolute values and positive / negative
    parts; ``npos_row`` / ``nneg_row`` counts of positive / negative advantages; ``ent_row`` entropy sums.
    """

    def _ratio(num, den):
        return float(num) / float(den) if float(den) > 0 else 0.0

    out: dict[str, float] = {}
    for name, rows in (("pos", correct), ("neg", ~correct)):
        n_tok = lens[rows].sum()
        mean = _ratio(w_row[rows].sum(), n_tok)
        var = max(_ratio(w2_row[rows].sum(), n_tok) - mean * mean, 0.0)
        live = rows & (lens > 0)
        out[f"weight_{name}_mean"] = mean
        out[f"weight_{name}_std"] = math.sqrt(var)
        out[f"weight_{name}_max"] = float(w_max[live].max()) if bool(live.any()) else 0.0
    n_valid = lens.sum()
    all_pos, all_neg = group_outcome_fracs(correct, lens > 0, gid, num_groups)
    out.update(
        {
            "shaped_correct_mean": _ratio(shaped_row[correct].sum(), lens[correct].sum()),
            "shaped_incorrect_mean": _ratio(shaped_row[~correct].sum(), lens[~correct].sum()),
            "adv_correct_mean": _ratio(adv_row[correct].sum(), lens[correct].sum()),
            "adv_incorrect_mean": _ratio(adv_row[~correct].sum(), lens[~correct].sum()),
            "adv_pos_mean": _ratio(pos_row.sum(), npos_row.sum()),
            "adv_neg_mean": _ratio(neg_row.sum(), nneg_row.sum()),
            "adv_abs_mean": _ratio(abs_row.sum(), n_valid),
            "frac_tokens_adv_pos": _ratio(npos_row.sum(), n_valid),
            "frac_tokens_adv_neg": _ratio(nneg_row.sum(), n_valid),
            "conservation_err": conservation_err,
            "frac_groups_all_correct": all_pos,
            "frac_groups_all_wrong": all_neg,
            "entropy_correct_mean": _ratio(ent_row[correct].sum(), lens[correct].sum()),
            "entropy_incorrect_mean": _ratio(ent_row[~correct].sum(), lens[~correct].sum()),
        }
    )
    return out
