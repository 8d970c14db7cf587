"""GTPO-trajectory's conflict tokens: the weights ``lambda`` and the counts ``n_conf``.

Paper: Simoni et al., "GTPO: Trajectory-Based Policy Optimization in LLMs", arXiv 2508.03772 (TACL 2026). Official
code: ``winstonsmith1897/GTPO`` (``build_conflict_mask``). Specification: docs/ALGORITHMS.md §6.2, §6.5.

Among the *active* completions of a group (``P = {A_i > 0}``, ``N = {A_i < 0}``), token ``(i, t)`` is
raw-conflicting when the pair (position, token id) occurs in at least one completion of ``P`` and one of ``N``
(``i`` itself counts). Only the leading contiguous run (forward, positions from the start) and the trailing
contiguous run (backward, positions counted from the last valid token, i.e. right-aligned) are conflicts.
``lambda = lambda_fwd * lambda_bwd * m`` with ``lambda_pos`` (2) on a positive completion's conflict tokens,
``lambda_neg`` (0) on a negative one's, 1 elsewhere; a token in both runs of a positive completion gets
``lambda_pos ** 2`` (4).

Deliberate choices and deviations:

1. Conflict detection never builds the ``[groups, G, G, L]`` comparison tensor of §6.6. Each valid token of an
   active completion becomes an int64 key ``((group * W) + position) * V + token``; membership of a key in the
   positive and in the negative key sets is a sort-based ``torch.isin``. Runs are found block by block over
   positions with doubling block widths (32, 64, ... capped at ``max_block``), and a block only visits groups that
   still have a row whose run is alive; memory is linear in the number of tokens and the typical cost is a few
   dozen positions per row. The backward run is the same scan on a right-aligned copy of the responses.
2. A position where ``response_mask`` is 0 inside a response (multi-turn tool tokens) ends a run, exactly like a
   padding token ends it in the official code. Padding is taken from ``response_mask``, never from a pad id (the
   official code's hard-coded Llama pad id is a defect we do not reproduce).
3. ``n_conf`` (§6.2 step 4) has two counts (:func:`run_conflict_counts`): ``union``, the number of tokens in
   either run (``f + b - overlap``, the specification's definition), and ``official``, ``max(f, b)``, what the
   official ``build_conflict_mask`` computes because it ORs the forward-run mask with the backward-run mask while
   the latter is still in reversed column order (§6.5). The weights ``lambda`` are the same under both.
"""

from __future__ import annotations

import torch

__all__ = [
    "NCONF_COUNTS",
    "check_conflict_inputs",
    "conflict_weights",
    "conflict_parts",
    "conflict_counts",
    "run_conflict_counts",
]

# How the 1/n_conf divisor counts a completion's conflict tokens (docs/ALGORITHMS.md §6.5).
NCONF_COUNTS = ("official", "union")


def check_conflict_inputs(responses, response_mask, gid, num_groups, polarity) -> None:
    if responses.dim() != 2:
        raise ValueError(f"responses must be [B, L], got shape {tuple(responses.shape)}")
    if response_mask.shape != responses.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != responses shape {tuple(responses.shape)}"
        )
    if responses.dtype.is_floating_point or responses.dtype == torch.bool:
        raise ValueError(f"responses must hold integer token ids, got dtype {responses.dtype}")
    b = responses.shape[0]
    if gid.shape != (b,) or polarity.shape != (b,):
        raise ValueError(f"gid {tuple(gid.shape)} and polarity {tuple(polarity.shape)} must both be [B]=[{b}]")
    if b and (int(gid.min()) < 0 or int(gid.max()) >= num_groups):
        raise ValueError(f"gid values must lie in [0, {num_groups}), got [{int(gid.min())}, {int(gid.max())}]")
    bad = ~((polarity == 1) | (polarity == -1) | (polarity == 0))
    if bool(bad.any()):
        raise ValueError(f"polarity must be +1, -1 or 0, got {polarity[bad][:5].tolist()}")


def _leading_runs(
    tok: torch.Tensor,
    valid: torch.Tensor,
    gid: torch.Tensor,
    pol: torch.Tensor,
    last: torch.Tensor | None,
    first_block: int,
    max_block: int,
) -> torch.Tensor:
    """Leading runs of raw-conflicting tokens along one direction.

    Args:
        tok: ``[R, L]`` int64 token ids (any value where ``valid`` is False).
        valid: ``[R, L]`` bool.
        gid: ``[R]`` int64 group ids (rows only meet rows of the same id).
        pol: ``[R]`` int8 polarity (+1, -1, 0).
        last: None for the forward run (aligned position ``d`` = column ``d``); for the backward run, ``[R]`` index
            of each row's last valid token (aligned position ``d`` = column ``last - d``; -1 for an empty row).
        first_block, max_block: block widths over aligned positions (doubling from ``first_block`` up to
            ``max_block``).

    Returns:
        ``(row_idx, col_idx, run_len)``: the (row, column) positions of the run tokens (column layout, active rows
        only) and ``[R]`` int64 run lengths. Only the blocks that some run reaches are ever read, so the cost is
        proportional to the run lengths and nothing of size ``[R, L]`` is allocated.
    """
    num_rows, length = tok.shape
    device = tok.device
    run_rows: list[torch.Tensor] = []
    run_cols: list[torch.Tensor] = []
    run_len = torch.zeros(num_rows, dtype=torch.long, device=device)
    pos_row = pol > 0
    neg_row = pol < 0
    active = pos_row | neg_row
    # A group can only have conflicts if it holds both polarities.
    num_ids = int(gid.max()) + 1 if num_rows else 0
    has_pos = torch.zeros(num_ids, dtype=torch.bool, device=device)
    has_neg = torch.zeros_like(has_pos)
    has_pos[gid[pos_row]] = True
    has_neg[gid[neg_row]] = True
    alive = active & has_pos[gid] & has_neg[gid]
    start, width = 0, first_block
    while start < length and bool(alive.any()):
        end = min(length, start + width)
        w = end - start
        group_alive = torch.zeros(num_ids, dtype=torch.bool, device=device)
        group_alive[gid[alive]] = True
        rows = torch.nonzero(group_alive[gid] & active, as_tuple=True)[0]
        d = torch.arange(start, end, device=device)
        if last is None:
            cols = d[None, :].expand(len(rows), w)
            inside = torch.ones(len(rows), w, dtype=torch.bool, device=device)
        else:
            cols = last[rows, None] - d[None, :]
            inside = cols >= 0
            cols = cols.clamp(min=0)
        sub_valid = valid[rows[:, None], cols] & inside
        sub_tok = torch.where(sub_valid, tok[rows[:, None], cols], 0)
        if bool(sub_valid.any()):
            lo, hi = int(sub_tok[sub_valid].min()), int(sub_tok.max())
            if lo < 0:
                raise ValueError(f"responses hold a negative token id {lo} on a valid position")
        else:
            hi = 0
        vocab = hi + 1
        if num_ids * w * vocab >= 2**62:
            raise ValueError(f"key space num_groups*block*vocab={num_ids}*{w}*{vocab} overflows int64")
        keys = (gid[rows, None] * w + (d - start)[None, :]) * vocab + sub_tok
        pos_keys = keys[sub_valid & pos_row[rows, None]]
        neg_keys = keys[sub_valid & neg_row[rows, None]]
        raw = sub_valid & torch.isin(keys, pos_keys) & torch.isin(keys, neg_keys)
        seg = torch.cumprod(raw.to(torch.uint8), dim=1).bool() & alive[rows, None]
        # Write back in column layout (inside the row, so no two aligned positions share a column).
        r_idx = rows[:, None].expand(len(rows), w)
        run_rows.append(r_idx[seg])
        run_cols.append(cols[seg])
        run_len.index_add_(0, rows, seg.sum(1))
        alive[rows] = seg[:, -1]
        start, width = end, min(2 * width, max_block)
    if not run_rows:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return empty, empty, run_len
    return torch.cat(run_rows), torch.cat(run_cols), run_len


@torch.no_grad()
def conflict_weights(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    polarity: torch.Tensor,
    lam_pos: float = 2.0,
    lam_neg: float = 0.0,
    *,
    first_block: int = 32,
    max_block: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conflict-token weights of GTPO-trajectory (docs/ALGORITHMS.md §6.2; official ``build_conflict_mask``).

    Args:
        responses: ``[B, L]`` int64 token ids, right-padded (values under the mask's zeros are ignored).
        response_mask: ``[B, L]`` 0/1 (bool, int or float); 1 on valid tokens, including EOS.
        gid: ``[B]`` int64 group ids in ``0 .. num_groups - 1``; rows may come in any order, groups in any size.
        num_groups: ``NG``.
        polarity: ``[B]`` int8: +1 positive completion (``A_i > 0``), -1 negative (``A_i < 0``), 0 inactive.
        lam_pos: weight of a positive completion's conflict token (paper: 2).
        lam_neg: weight of a negative completion's conflict token (paper: 0).
        first_block, max_block: block widths of the position scan (performance only; results do not depend on
            them).

    Returns:
        ``(lam, is_conflict)``: ``lam`` ``[B, L]`` float32 = ``lambda_fwd * lambda_bwd * m`` (1 on the valid tokens
        of inactive rows and of non-conflict tokens, 0 on padding); ``is_conflict`` ``[B, L]`` bool, True on tokens
        of the leading (forward) or trailing (backward, right-aligned) run. A group without a positive or without
        a negative completion has no conflicts.
    """
    lam, is_conflict, _, _, _ = conflict_parts(
        responses, response_mask, gid, num_groups, polarity, lam_pos, lam_neg, first_block, max_block
    )
    return lam, is_conflict


def conflict_parts(responses, response_mask, gid, num_groups, polarity, lam_pos, lam_neg, first_block, max_block):
    """:func:`conflict_weights` plus ``[B]`` int64 forward / backward run lengths and the last valid column.

    ``lam`` starts as the float mask and only the run positions are rescaled (a token in both runs twice), so
    the cost beyond one pass over the mask is proportional to the number of conflict tokens.
    """
    check_conflict_inputs(responses, response_mask, gid, num_groups, polarity)
    if first_block < 1 or max_block < first_block:
        raise ValueError(f"first_block={first_block}, max_block={max_block}: need 1 <= first_block <= max_block")
    device = responses.device
    mask = response_mask.to(device=device)
    valid = mask if mask.dtype == torch.bool else mask.bool()
    b, length = responses.shape
    if length == 0 or b == 0:
        zero = torch.zeros(b, dtype=torch.long, device=device)
        return (
            torch.zeros(responses.shape, dtype=torch.float32, device=device),
            torch.zeros_like(valid),
            zero,
            zero,
            zero - 1,
        )
    pol = polarity.to(device=device, dtype=torch.int8)
    gid = gid.to(device=device, dtype=torch.long)
    # Index of each row's last valid token (-1 for an empty row); the backward run is right-aligned on it.
    last = (length - 1) - valid.view(torch.uint8).flip(1).argmax(dim=1)
    last = torch.where(valid[torch.arange(b, device=device), last], last, torch.full_like(last, -1))

    f_rows, f_cols, f_len = _leading_runs(responses, valid, gid, pol, None, first_block, max_block)
    b_rows, b_cols, b_len = _leading_runs(responses, valid, gid, pol, last, first_block, max_block)

    lam_c = torch.where(pol > 0, lam_pos, lam_neg).to(torch.float32)
    lam = valid.to(torch.float32)
    is_conflict = torch.zeros_like(valid)
    for rows, cols in ((f_rows, f_cols), (b_rows, b_cols)):
        if rows.numel():
            lam[rows, cols] = lam[rows, cols] * lam_c[rows]
            is_conflict[rows, cols] = True
    return lam, is_conflict, f_len, b_len, last


@torch.no_grad()
def conflict_counts(is_conflict: torch.Tensor, polarity: torch.Tensor) -> torch.Tensor:
    """``n_conf`` per row (§6.2 step 4): number of conflict tokens, clamped to >= 1; inactive rows give 1.

    Args:
        is_conflict: ``[B, L]`` bool from :func:`conflict_weights`.
        polarity: ``[B]`` int8.

    Returns:
        ``[B]`` int64 divisor (the official code stores 0 for inactive rows and treats it as 1; the divisor is the
        same).
    """
    count = is_conflict.sum(dim=-1)
    return torch.where(polarity != 0, count.clamp(min=1), torch.ones_like(count))


@torch.no_grad()
def run_conflict_counts(
    f_len: torch.Tensor, b_len: torch.Tensor, last: torch.Tensor, polarity: torch.Tensor, count: str = "union"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n_conf`` divisor from the run lengths of :func:`conflict_parts` (§6.2 step 4, §6.5).

    Args:
        f_len, b_len: ``[B]`` int64 lengths ``f`` / ``b`` of the leading (forward) and trailing (backward) runs.
        last: ``[B]`` int64 column of each row's last valid token (-1 for an empty row).
        polarity: ``[B]`` int8.
        count: ``"union"``: tokens in either run, ``f + b - overlap``; ``"official"``: ``max(f, b)``, the official
            code's count (docs/ALGORITHMS.md §6.5, worked example there).

    Returns:
        ``(n_conf, n_conflict, overlap)``, all ``[B]`` int64: the divisor (``count`` clamped to >= 1 on active rows,
        1 on inactive ones), the number of conflict tokens (always the union) and the tokens in both runs (forward
        run: columns ``[0, f)``; backward run: ``(last - b, last]``).
    """
    if count not in NCONF_COUNTS:
        raise ValueError(f"nconf_count={count!r}: must be one of {list(NCONF_COUNTS)}")
    overlap = (f_len + b_len - (last + 1)).clamp(min=0)
    n_conflict = f_len + b_len - overlap
    counted = torch.maximum(f_len, b_len) if count == "official" else n_conflict
    n_conf = torch.where(polarity != 0, counted.clamp(min=1), torch.ones_like(counted))
    return n_conf, n_conflict, overlap
