"""Where a token sits when a response holds tokens the model did not write (multi-turn tool use).

verl's ``ToolAgentLoop`` appends each tool's output, wrapped in the chat template's turn markers, to the response and
marks those tokens 0 in ``response_mask``; the model's own tokens of every assistant turn are 1. The position-wise
estimators need a "position t": GTPO-token's entropy shares and counts (arXiv 2508.04349, Eq. 3 / 5: "normalized
across all n successful sequences at timestep t", ``d_t`` "the count of successful sequences with length >= t") and
GTPO-trajectory's conflict runs (arXiv 2508.03772: tokens at the same position of a positive and a negative
completion). Both papers are single-turn. The readings (docs/ALGORITHMS.md §13, ``algorithm.<estimator>.position``):

- ``model`` (the default): t is the token's index among the model's own tokens of its response; tool tokens take no
  position. A tool output of 1 token or of 500 leaves every model token's position, and so its advantage, unchanged.
- ``raw``: t is the column in the response; a tool token is a hole that no sum or count reads.
- ``turn`` (GTPO-token only): t is the pair (assistant turn k, index within turn k); positions restart at each turn.

A :class:`PositionLayout` places each row's model tokens in the columns of a ``[B, W]`` tensor that read the chosen
position; the estimator runs there (kernel or definition alike) and its result is scattered back, 0 on every tool
token and on padding. A mask whose model tokens are one block from column 0 in every row (every single-turn batch)
reads the same under all three, so :func:`position_layout` returns None and nothing is copied. On CPU the compiled
kernels find gaps in the first pass they make anyway (:class:`gtpo.algorithms.gaps.MaskGaps`), so that path costs
nothing; elsewhere :func:`has_gaps` reads the mask once.
"""

from __future__ import annotations

from functools import cached_property

import torch

from gtpo.algorithms.kernel_dispatch import kernel_guard, kernel_on, row_sums

__all__ = [
    "POSITIONS",
    "CompactLayout",
    "PositionLayout",
    "has_gaps",
    "position_layout",
    "tool_turn_metrics",
    "turn_index",
]

POSITIONS = ("model", "raw", "turn")


class PositionLayout:
    """Where each model token of a ``[B, L]`` response batch goes in the ``[B, width]`` layout.

    Attributes:
        rows, cols: ``[N]`` int64 row and column of every model token (``response_mask != 0``), row-major.
        dest: ``[N]`` int64 its column in the layout.
        shape: ``(B, L)`` of the responses.
        width: ``W``, the layout's number of columns.
    """

    def __init__(self, rows: torch.Tensor, cols: torch.Tensor, dest: torch.Tensor, shape: tuple[int, int], width: int):
        self.rows, self.cols, self.dest, self.shape, self.width = rows, cols, dest, shape, width

    def gather(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """``[B, L]`` -> ``[B, W]``: each model token's value at its layout column, ``fill`` elsewhere (the response
        mask gathered is the layout's mask, its values kept so that the estimators' checks still see them)."""
        out = torch.full((self.shape[0], self.width), fill, dtype=values.dtype, device=values.device)
        out[self.rows, self.dest] = values[self.rows, self.cols]
        return out

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[B, W]`` -> ``[B, L]``: each model token takes its layout value; tool tokens and padding are 0."""
        out = torch.zeros(self.shape, dtype=values.dtype, device=values.device)
        out[self.rows, self.cols] = values[self.rows, self.dest]
        return out


class CompactLayout(PositionLayout):
    """``position=model``: each row's model tokens in columns ``0 .. n_i - 1``, in order. On CPU both directions are
    one compiled pass over the rows (the token indices of :class:`PositionLayout` cost seconds at 8192 x 4096);
    elsewhere, or for a dtype the kernels do not read, the indices."""

    def __init__(self, response_mask: torch.Tensor, width: int):
        self.response_mask = response_mask.detach()
        self.shape = (int(response_mask.shape[0]), int(response_mask.shape[1]))
        self.width = width

    @cached_property
    def _index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, cols, _, _ = turn_index(self.response_mask)
        counts = torch.bincount(rows, minlength=self.shape[0])
        row_start = torch.cumsum(counts, 0) - counts
        return rows, cols, torch.arange(rows.numel(), device=rows.device) - row_start[rows]

    rows = property(lambda self: self._index[0])
    cols = property(lambda self: self._index[1])
    dest = property(lambda self: self._index[2])

    def _compiled(self, values: torch.Tensor) -> bool:
        return (
            values.device.type == "cpu"
            and self.response_mask.device.type == "cpu"
            and values.dim() == 2
            and (values.dtype in _COMPACTED_DTYPES and kernel_on("compact_rows"))
        )

    def gather(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        if self._compiled(values):
            with kernel_guard("compact_rows"):  # numba missing or failing: the indices below
                from gtpo.algorithms import kernels

                return kernels.compact_rows(values, self.response_mask, self.width, fill)
        return super().gather(values, fill)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        if self._compiled(values):
            with kernel_guard("compact_rows"):
                from gtpo.algorithms import kernels

                return kernels.expand_rows(values, self.response_mask)
        return super().scatter(values)


# what the compaction kernels read as they are (bool as bytes); other dtypes go through the indices
_COMPACTED_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool)


def has_gaps(response_mask: torch.Tensor) -> bool:
    """Whether some row's model tokens are not one block starting at column 0 (a tool output, or masked tokens before
    the first model token). CPU masks are read once by a compiled loop that stops at the first such row."""
    mask = response_mask.detach()
    if mask.device.type == "cpu" and mask.dim() == 2 and kernel_on("mask_gaps"):
        with kernel_guard("mask_gaps"):  # numba missing or failing: torch below
            from gtpo.algorithms import kernels

            return kernels.mask_has_gaps(mask)
    valid = mask != 0
    if valid.shape[-1] == 0:
        return False
    starts = valid[:, 1:] & ~valid[:, :-1]
    return bool(starts.any()) or bool((valid.any(-1) & ~valid[:, 0]).any())


def turn_index(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, turn, offset)``, each ``[N]`` int64 over the model tokens (row-major): the assistant turn of each
    model token (0, 1, ...: a turn is a maximal run of model tokens) and its index within that turn."""
    valid = response_mask.detach() != 0
    rows, cols = valid.nonzero(as_tuple=True)
    n = rows.numel()
    index = torch.arange(n, device=rows.device)
    if n == 0:
        return rows, cols, index, index
    previous = valid[rows, (cols - 1).clamp(min=0)] & (cols > 0)
    starts = ~previous  # the first model token of each turn
    turn_global = torch.cumsum(starts.to(torch.long), 0) - 1
    row_first = torch.ones_like(starts)
    row_first[1:] = rows[1:] != rows[:-1]
    first_turn = torch.cummax(torch.where(row_first, turn_global, -1), 0).values
    start_at = torch.cummax(torch.where(starts, index, -1), 0).values
    return rows, cols, turn_global - first_turn, index - start_at


def position_layout(response_mask: torch.Tensor, position: str, gaps: bool | None = None) -> PositionLayout | None:
    """The layout in which the estimators read ``position`` (one of :data:`POSITIONS`), or None when it is the
    responses' own: ``raw``, or a mask without gaps (:func:`has_gaps`, unless ``gaps`` says it: a kernel's first pass
    found them).

    ``model`` moves each row's model tokens to columns ``0 .. n_i - 1`` in order. ``turn`` gives turn k of every row
    the same block of columns, as wide as the longest turn k of the batch, and places a turn's tokens from the block's
    first column; a row's turn k is then compared with every other row's turn k, token by token from its start. The
    width is at most the number of turns times ``L``.
    """
    if position not in POSITIONS:
        raise ValueError(f"position={position!r}: must be one of {list(POSITIONS)}")
    if position == "raw" or not (has_gaps(response_mask) if gaps is None else gaps):
        return None
    if position == "model":
        width = int(row_sums(response_mask != 0).max()) if response_mask.numel() else 0
        return CompactLayout(response_mask, width) if width else None
    shape = (int(response_mask.shape[0]), int(response_mask.shape[1]))
    rows, cols, turn, offset = turn_index(response_mask)
    if rows.numel() == 0:
        return None
    turns = int(turn.max()) + 1
    turn_lengths = torch.bincount(rows * turns + turn, minlength=shape[0] * turns).view(shape[0], turns)
    block = turn_lengths.amax(0)
    block_start = torch.cumsum(block, 0) - block
    return PositionLayout(rows, cols, block_start[turn] + offset, shape, int(block.sum()))


@torch.no_grad()
def tool_turn_metrics(response_mask: torch.Tensor, entropy: torch.Tensor) -> dict[str, float]:
    """What tool use did in a batch, from the mask and the old policy's entropy (never read on a masked token).

    A tool output is a run of masked tokens between two model tokens of a response (one per tool turn: every call of
    that turn answered in it). Returns ``tool_outputs_per_response`` (their mean count per response),
    ``tool_response_frac`` (the share of responses with one), ``masked_token_frac`` (the masked tokens' share of the
    tokens up to each response's last model token), ``entropy_other_mean`` (the mean entropy of the model tokens
    that do not follow a tool output) and, when some model token follows one, ``entropy_after_tool_mean`` (the mean
    entropy of those first tokens after a tool output: the signal ARPO, arXiv 2507.19849, reports spiking).
    """
    valid = response_mask.detach() != 0
    rows = valid.shape[0]
    if valid.shape[-1] == 0 or rows == 0:
        return {"tool_outputs_per_response": 0.0, "tool_response_frac": 0.0, "masked_token_frac": 0.0}
    before = torch.nn.functional.pad(valid[:, :-1], (1, 0))
    seen = torch.cummax(valid.to(torch.uint8), -1).values.bool()  # at or after the row's first model token
    after_tool = valid & ~before & torch.nn.functional.pad(seen[:, :-1], (1, 0))
    span = torch.cummax(valid.flip(-1).to(torch.uint8), -1).values.flip(-1).bool()  # up to the last model token
    h = entropy.detach().to(torch.float64)
    other = valid & ~after_tool
    outputs = after_tool.sum(-1)
    out = {
        "tool_outputs_per_response": float(outputs.sum()) / rows,
        "tool_response_frac": float((outputs > 0).sum()) / rows,
        "masked_token_frac": float((span & ~valid).sum()) / max(int(span.sum()), 1),
        "entropy_other_mean": float(torch.where(other, h, 0.0).sum()) / max(int(other.sum()), 1),
    }
    if bool(after_tool.any()):
        out["entropy_after_tool_mean"] = float(torch.where(after_tool, h, 0.0).sum()) / int(after_tool.sum())
    return out
