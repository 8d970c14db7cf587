"""Multi-turn batches (tool outputs inside responses) and the invariant checks of the estimators on them.

A row is written as alternating segment lengths, model tokens first: ``[3, 2, 4]`` is a 3-token assistant turn, a
2-token tool output (``response_mask`` 0, as verl's ``ToolAgentLoop`` leaves it) and a 4-token assistant turn. A row's
model tokens get the same entropies and ids whatever its tool outputs' lengths, so two batches that differ only in a
tool output's length have the same model tokens.

Each ``check_*`` raises ``AssertionError`` naming the broken invariant (docs/ALGORITHMS.md §13).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from gtpo.algorithms.group_ops import group_ids
from gtpo.algorithms.grpo_s import GRPOSParams, grpo_s_advantages
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages
from gtpo.algorithms.gtpo_traj import GTPOTrajParams, gtpo_traj_advantages

TOOL_ID = 99


@dataclass(frozen=True)
class ToolBatch:
    """``[B, L]`` entropy / mask / responses, ``[B]`` rewards and groups, and ``tool``: the tool tokens (mask 0
    inside a response)."""

    entropy: torch.Tensor
    mask: torch.Tensor
    responses: torch.Tensor
    rewards: torch.Tensor
    gid: torch.Tensor
    num_groups: int
    tool: torch.Tensor
    uids: np.ndarray

    def with_tool_entropy(self, value: float) -> ToolBatch:
        """The same batch with ``value`` on every tool token's entropy."""
        return replace(self, entropy=torch.where(self.tool, torch.full_like(self.entropy, value), self.entropy))


def tool_batch(rows, rewards, groups, *, seed=0, width=None, tool_entropy=1.0, model_entropy=None) -> ToolBatch:
    """A batch of multi-turn rows (segment lengths, model tokens first), right-padded with NaN entropy.

    ``model_entropy``: a row's model-token entropies (a list per row); default U[0.2, 3] drawn per row from ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    width = width or max(sum(row) for row in rows)
    b = len(rows)
    mask = torch.zeros(b, width, dtype=torch.long)
    tool = torch.zeros(b, width, dtype=torch.bool)
    entropy = torch.full((b, width), math.nan)
    responses = torch.zeros(b, width, dtype=torch.long)
    for i, row in enumerate(rows):
        n_model = sum(row[0::2])
        h = (
            torch.as_tensor(model_entropy[i], dtype=torch.float32)
            if model_entropy
            else 0.2 + 2.8 * torch.rand(n_model, generator=gen)
        )
        ids = torch.randint(0, 4, (n_model,), generator=gen)
        col, k = 0, 0
        for s, length in enumerate(row):
            if s % 2 == 0:
                mask[i, col : col + length] = 1
                entropy[i, col : col + length] = h[k : k + length]
                responses[i, col : col + length] = ids[k : k + length]
                k += length
            elif s < len(row) - 1:  # a tool output between two assistant turns
                tool[i, col : col + length] = True
                entropy[i, col : col + length] = tool_entropy
                responses[i, col : col + length] = TOOL_ID
            col += length
    uids = np.asarray(groups, dtype=object)
    gid, num_groups = group_ids(uids)
    return ToolBatch(entropy, mask, responses, torch.tensor(rewards, dtype=torch.float32), gid, num_groups, tool, uids)


# The estimator settings the invariants are checked under: name, knobs, and whether the knobs read positions.
ESTIMATORS = {
    "gtpo": ("gtpo", {}),
    "gtpo_raw": ("gtpo", {"position": "raw"}),
    "gtpo_turn": ("gtpo", {"position": "turn"}),
    "gtpo_group_scopes": ("gtpo", {"weight_scope": "group", "norm_scope": "group"}),
    "gtpo_conflict_mask": ("gtpo", {"conflict_mask": True}),
    "grpo_s": ("grpo_s", {}),
    "gtpo_traj": ("gtpo_traj", {"h_ini": 2.0}),
    "gtpo_traj_raw": ("gtpo_traj", {"h_ini": 2.0, "position": "raw"}),
    "gtpo_traj_code": ("gtpo_traj", {"variant": "code", "tau": math.inf}),
}


def advantages(setting: str, batch: ToolBatch) -> torch.Tensor:
    """The entry point's ``[B, L]`` advantages of an :data:`ESTIMATORS` setting on ``batch``."""
    name, knobs = ESTIMATORS[setting]
    b = batch
    if name == "gtpo":
        return gtpo_token_advantages(
            b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOParams(**knobs), responses=b.responses
        )[0]
    if name == "grpo_s":
        return grpo_s_advantages(b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GRPOSParams(**knobs))[0]
    return gtpo_traj_advantages(
        b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOTrajParams(**knobs), responses=b.responses
    )[0]


def check_tool_tokens_zero(adv: torch.Tensor, batch: ToolBatch) -> None:
    """Every tool token's advantage is exactly 0 (and every padding token's)."""
    off = adv[batch.mask == 0]
    assert torch.count_nonzero(off) == 0, f"{torch.count_nonzero(adv[batch.tool])} tool token(s) carry an advantage"


def check_tool_entropy_unread(fn: Callable[[ToolBatch], torch.Tensor], batch: ToolBatch) -> None:
    """NaN, 1e9, a negative value or 0 on the tool tokens' entropy changes no advantage (bit for bit)."""
    ref = fn(batch.with_tool_entropy(1.0))
    for value in (math.nan, 1e9, -5.0, 0.0):
        got = fn(batch.with_tool_entropy(value))
        assert torch.equal(got, ref), f"tool-token entropy {value} changed the advantages: it was read"


def model_tokens(adv: torch.Tensor, batch: ToolBatch) -> torch.Tensor:
    """The model tokens' advantages, row by row in order (``[N]``)."""
    return adv[batch.mask.bool()]


def position_keys(batch: ToolBatch, position: str) -> torch.Tensor:
    """``[B, L]`` int64 key of each model token's position under ``position`` (-1 elsewhere), computed here from the
    mask alone: the column (``raw``), the index among the row's model tokens (``model``), or turn * 10_000 + index
    within the turn (``turn``)."""
    m = batch.mask.bool()
    cols = torch.arange(m.shape[1]).expand_as(m)
    if position == "raw":
        return torch.where(m, cols, -1)
    model_index = torch.cumsum(m.long(), -1) - 1
    if position == "model":
        return torch.where(m, model_index, -1)
    starts = m & ~torch.nn.functional.pad(m[:, :-1], (1, 0))
    turn = torch.cumsum(starts.long(), -1) - 1
    start_index = torch.cummax(torch.where(starts, model_index, -1), -1).values
    return torch.where(m, turn * 10_000 + model_index - start_index, -1)


def check_conservation(adv: torch.Tensor, batch: ToolBatch, position: str, rtol: float = 1e-4) -> None:
    """GTPO ``zero_fill`` with batch scopes and +-1 rewards: the shaped rewards of one polarity at one position sum
    to ``a1 * sum(base) +- a2 * count`` (Prop. 2.2), so after Eq. 6's whitening (one affine map per polarity) the mean
    advantage of that polarity's tokens at each position is the same number at every position."""
    keys = position_keys(batch, position)
    for polarity in (batch.rewards > 0, batch.rewards <= 0):
        sel = batch.mask.bool() & polarity[:, None]
        means = []
        for key in torch.unique(keys[sel]).tolist():
            at = sel & (keys == key)
            means.append(float(adv[at].double().mean()))
        spread = max(means) - min(means)
        assert spread <= rtol * max(abs(m) for m in means), (
            f"position={position}: the per-position means of one polarity differ by {spread:.3g}: the shares of a "
            "position do not sum to its count"
        )


def check_gradient_tokens_match_grpo(adv: torch.Tensor, batch: ToolBatch, subset: bool = False) -> None:
    """The tokens with a non-zero advantage are verl GRPO's (every model token of a mixed group), or a subset of
    them where the method zeroes some on purpose (``subset``: conflict weights lambda- = 0, filtered completions)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = torch.zeros(batch.mask.shape)
    last = (batch.mask * torch.arange(1, batch.mask.shape[1] + 1)).argmax(-1)
    scores[torch.arange(len(last)), last] = batch.rewards
    grpo, _ = compute_grpo_outcome_advantage(scores, batch.mask.float(), batch.uids)
    grpo_tokens, tokens = grpo != 0, adv != 0
    assert not bool((tokens & ~grpo_tokens).any()), "a token outside GRPO's gradient set carries an advantage"
    if not subset:
        assert torch.equal(tokens, grpo_tokens), "the tokens that carry gradient differ from verl GRPO's"
