"""GTPO-trajectory's conflict tokens: the runs, the weights ``lambda`` and the counts ``n_conf``.

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

1. Conflict detection never builds the ``[groups, G, G, L]`` comparison tensor of §6.6. A run is found block by block
   over positions with doubling widths (32, 64, ...): each valid token of a block becomes an int64 key
   ``((group * W) + position) * V + token``, and membership in the positive and in the negative key sets is a
   sort-based ``torch.isin``; a block only visits groups that still have a row whose run is alive. The cost is
   proportional to the run lengths, and the runs are kept as lengths (:class:`Runs`), never as ``[B, L]`` masks.
2. A position where ``response_mask`` is 0 inside a row ends a run, exactly like a padding token ends it in the
   official code. Padding is taken from ``response_mask``, never from a pad id (the official code's hard-coded Llama
   pad id is a defect not reproduced). Tool outputs inside multi-turn responses reach this function so only under
   ``position=raw``; by default the estimators pass it the model's tokens in order (docs/ALGORITHMS.md §13).
3. ``n_conf`` (§6.2 step 4) has two counts (:meth:`Runs.n_conf`): ``union``, the tokens in either run
   (``f + b - overlap``, the specification's definition), and ``official``, ``max(f, b)``, what the official
   ``build_conflict_mask`` computes because it ORs the forward-run mask with the backward-run mask while the latter
   is still in reversed column order (§6.5). The weights ``lambda`` are the same under both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["NCONF_COUNTS", "Runs", "conflict_runs", "conflict_weights", "run_weights", "scale_runs"]

# How the 1/n_conf divisor counts a completion's conflict tokens (docs/ALGORITHMS.md §6.5).
NCONF_COUNTS = ("official", "union")
FIRST_BLOCK = 32


class Runs(NamedTuple):
    """The conflict runs of each row: the first ``fwd`` and the last ``bwd`` valid columns, ending at ``last``."""

    fwd: torch.Tensor  # [B] int64 length of the leading (forward) run
    bwd: torch.Tensor  # [B] int64 length of the trailing (backward, right-aligned) run
    last: torch.Tensor  # [B] int64 column of the row's last valid token (-1: empty row)

    def overlap(self) -> torch.Tensor:
        """``[B]`` tokens in both runs (forward run: columns ``[0, fwd)``; backward run: ``(last - bwd, last]``)."""
        return (self.fwd + self.bwd - (self.last + 1)).clamp(min=0)

    def conflict_tokens(self) -> torch.Tensor:
        """``[B]`` conflict tokens: the union of the two runs."""
        return self.fwd + self.bwd - self.overlap()

    def n_conf(self, polarity: torch.Tensor, count: str = "union") -> torch.Tensor:
        """``[B]`` int64 divisor ``n_conf``: ``union`` or ``official`` (``max(f, b)``), >= 1; 1 on inactive rows."""
        if count not in NCONF_COUNTS:
            raise ValueError(f"nconf_count={count!r}: must be one of {list(NCONF_COUNTS)}")
        counted = torch.maximum(self.fwd, self.bwd) if count == "official" else self.conflict_tokens()
        return torch.where(polarity != 0, counted.clamp(min=1), torch.ones_like(counted))


def check_conflict_inputs(responses, response_mask, gid, num_groups, polarity) -> None:
    if not isinstance(responses, torch.Tensor) or responses.dim() != 2:
        raise ValueError(f"responses must be [B, L], got {getattr(responses, 'shape', type(responses).__name__)}")
    if response_mask.shape != responses.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} != responses {tuple(responses.shape)}")
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


@torch.no_grad()
def conflict_runs(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    gid: torch.Tensor,
    num_groups: int,
    polarity: torch.Tensor,
    *,
    first_block: int = FIRST_BLOCK,
    max_block: int = 4096,
) -> Runs:
    """The forward and backward conflict runs of every row (docs/ALGORITHMS.md §6.2; official ``build_conflict_mask``).

    Args:
        responses: ``[B, L]`` int64 token ids (values under the mask's zeros are ignored).
        response_mask: ``[B, L]`` 0/1 (bool, int or float); 1 on valid tokens, including EOS.
        gid: ``[B]`` int64 group ids in ``0 .. num_groups - 1``; rows in any order, groups of any size.
        num_groups: ``NG``.
        polarity: ``[B]`` +1 positive completion, -1 negative, 0 inactive. A group without a positive or without a
            negative completion has no conflicts.
        first_block, max_block: block widths of the position scan (performance only; results do not depend on them).
    """
    check_conflict_inputs(responses, response_mask, gid, num_groups, polarity)
    if first_block < 1 or max_block < first_block:
        raise ValueError(f"first_block={first_block}, max_block={max_block}: need 1 <= first_block <= max_block")
    device = responses.device
    num_rows, length = responses.shape
    pol = polarity.to(device=device, dtype=torch.int8)
    gid = gid.to(device=device, dtype=torch.long)
    # each row's last valid column (-1 for an empty row): the backward run is right-aligned on it
    columns = torch.arange(1, length + 1, device=device)
    last = (
        (response_mask.to(device) != 0).long().mul_(columns).amax(-1) - 1
        if length
        else torch.full((num_rows,), -1, dtype=torch.long, device=device)
    )
    fwd = _leading_runs(responses, response_mask, gid, pol, None, first_block, max_block)
    bwd = _leading_runs(responses, response_mask, gid, pol, last, first_block, max_block)
    return Runs(fwd, bwd, last)


def _leading_runs(tok, mask, gid, pol, last, first_block: int, max_block: int) -> torch.Tensor:
    """``[R]`` int64 lengths of the leading runs of raw-conflicting tokens along one direction.

    ``last`` is None for the forward run (aligned position ``d`` = column ``d``); for the backward run, each row's
    last valid column (aligned position ``d`` = column ``last - d``). Only the blocks some run reaches are read.
    """
    num_rows, length = tok.shape
    device = tok.device
    run_len = torch.zeros(num_rows, dtype=torch.long, device=device)
    pos_row, neg_row = pol > 0, pol < 0
    active = pos_row | neg_row
    num_ids = int(gid.max()) + 1 if num_rows else 0
    has_pos = torch.zeros(num_ids, dtype=torch.bool, device=device)
    has_neg = torch.zeros_like(has_pos)
    has_pos[gid[pos_row]] = True
    has_neg[gid[neg_row]] = True
    alive = active & has_pos[gid] & has_neg[gid]  # a group needs both polarities to conflict
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
        sub_valid = (mask[rows[:, None], cols] != 0) & inside
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
        run_len.index_add_(0, rows, seg.sum(1))
        alive[rows] = seg[:, -1]
        start, width = end, min(2 * width, max_block)
    return run_len


def _run_tokens(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, step d)`` of every token of runs of the given ``[R]`` lengths: ``d`` counts 0, 1, ... along each run."""
    local = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return local, torch.arange(len(local), device=lengths.device) - starts[local]


def scale_runs(values: torch.Tensor, runs: Runs, lam: torch.Tensor, rows: slice | torch.Tensor | None = None) -> None:
    """Multiply the run tokens of ``values`` by their row's ``lam`` (``[B]``), in place; a token in both runs twice.

    ``values`` holds the rows ``rows`` of the batch (a slice or an index tensor; None: all rows), in that order. The
    cost is the number of run tokens.
    """
    index = torch.arange(values.shape[0], device=values.device) if rows is None else rows
    if isinstance(index, slice):
        index = torch.arange(index.start, index.stop, device=values.device)
    local, steps = _run_tokens(runs.fwd[index])
    values[local, steps] *= lam[index[local]].to(values.dtype)
    local, steps = _run_tokens(runs.bwd[index])
    values[local, runs.last[index[local]] - steps] *= lam[index[local]].to(values.dtype)


def run_weights(runs: Runs, rows: slice | torch.Tensor, length: int, lam: torch.Tensor) -> torch.Tensor:
    """``[R, L]`` float32 ``lambda_fwd * lambda_bwd`` of the rows ``rows`` (``lam`` per run token, 1 elsewhere)."""
    count = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
    weights = torch.ones(count, length, dtype=torch.float32, device=runs.fwd.device)
    scale_runs(weights, runs, lam, rows)
    return weights


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
    first_block: int = FIRST_BLOCK,
    max_block: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lam [B, L] float32, is_conflict [B, L] bool)``: the dense weights ``lambda_fwd * lambda_bwd * m`` (1 on the
    valid tokens of inactive rows and of non-conflict tokens, 0 on padding) and the run tokens."""
    runs = conflict_runs(
        responses, response_mask, gid, num_groups, polarity, first_block=first_block, max_block=max_block
    )
    num_rows, length = responses.shape
    lam_c = torch.where(polarity > 0, lam_pos, lam_neg).to(torch.float32).to(responses.device)
    lam = response_mask.to(torch.float32).clone()
    scale_runs(lam, runs, lam_c)
    marks = torch.ones(num_rows, length, dtype=torch.float32, device=responses.device)
    scale_runs(marks, runs, torch.zeros(num_rows, dtype=torch.float32, device=responses.device))
    return lam, marks == 0
