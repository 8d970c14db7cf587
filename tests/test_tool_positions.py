"""The estimators on responses with tool outputs inside them (multi-turn tool use, docs/ALGORITHMS.md §13).

    .venv/bin/python -m pytest -q -n 0 tests/test_tool_positions.py

verl's ToolAgentLoop leaves ``response_mask`` 0 on every tool-output token inside a response. Checked for every
estimator and position (``algorithm.<estimator>.position``), on the compiled kernels and on the definitions: a tool
token's advantage is exactly 0; its entropy is never read; a tool output of 1 token or of 500 leaves the model tokens'
advantages unchanged under the default; each position keeps Eq. 3's conservation at its own positions; ``turn``
reduces to the single-turn estimator on one-turn responses; the tokens that carry gradient are verl GRPO's. Each check
is also run with a fault planted in the layout code and must then fail. Last, the step metrics of tool use.
"""

from __future__ import annotations

import math

import pytest
import torch

from gtpo.algorithms import gtpo_token, gtpo_traj, kernel_dispatch, kernels
from gtpo.algorithms.gaps import MaskGaps
from gtpo.algorithms.gtpo_token import GTPOParams, gtpo_token_advantages, gtpo_token_definition
from gtpo.algorithms.gtpo_traj import GTPOTrajParams
from gtpo.algorithms.token_positions import (
    CompactLayout,
    PositionLayout,
    has_gaps,
    position_layout,
    tool_turn_metrics,
    turn_index,
)
from gtpo.methods import knob
from tests.support.tool_batches import (
    ESTIMATORS,
    advantages,
    check_conservation,
    check_gradient_tokens_match_grpo,
    check_tool_entropy_unread,
    check_tool_tokens_zero,
    model_tokens,
    tool_batch,
)

KERNELS = ("gtpo_token", "grpo_s", "gtpo_traj", "mask_gaps")
# Two groups of four: assistant turns with tool outputs between them, mixed rewards in each group.
ROWS = [[3, 2, 4], [2, 5, 1, 1, 2], [5], [1, 3, 3], [4, 1, 2], [2, 2, 2, 3, 1], [6], [3, 4, 2]]
REWARDS = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0]
GROUPS = ["a", "a", "a", "a", "b", "b", "b", "b"]


@pytest.fixture(params=["kernel", "definition"])
def evaluation(request, monkeypatch):
    """Each check on the compiled kernels and on the float64 definitions."""
    if request.param == "definition":
        monkeypatch.setattr(kernel_dispatch, "_OFF", set(KERNELS))
    return request.param


def batch(**kw):
    return tool_batch(ROWS, REWARDS, GROUPS, **kw)


# ---------------------------------------------------------------------------------------------------------------------
# the layouts, by hand


def test_layouts_by_hand():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    rows, cols, turn, offset = turn_index(mask)
    assert turn.tolist() == [0, 0, 1, 1, 1, 0, 1, 0, 0, 0]
    assert offset.tolist() == [0, 1, 0, 1, 2, 0, 0, 0, 1, 2]
    model = position_layout(mask, "model")
    assert model.width == 5 and model.dest.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2]
    # turn 0's block is 3 wide (row 2's only turn), turn 1's block 3 wide (row 0's second turn)
    turns = position_layout(mask, "turn")
    assert turns.width == 6 and turns.dest.tolist() == [0, 1, 3, 4, 5, 0, 3, 0, 1, 2]
    values = torch.arange(24.0).view(3, 8)
    assert model.gather(values).tolist() == [[0, 1, 4, 5, 6], [8, 10, 0, 0, 0], [16, 17, 18, 0, 0]]
    assert turns.gather(values, fill=-1).tolist()[1] == [8, -1, -1, 10, -1, -1]
    back = model.scatter(model.gather(values))
    assert torch.equal(back, values * mask)
    assert position_layout(mask, "raw") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool, torch.bfloat16])
def test_the_compiled_compaction_is_the_index_path(dtype):
    """``model`` on CPU moves tokens with compiled passes; they give what the token indices give, both ways."""
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(37, 29, generator=gen) > 0.3).long() * (torch.arange(29) < 25).long()
    values = (torch.rand(37, 29, generator=gen) * 10).to(dtype)
    layout = position_layout(mask, "model")
    assert isinstance(layout, CompactLayout) and layout.width == int(mask.sum(-1).max())
    packed = layout.gather(values, fill=1)
    assert torch.equal(packed, PositionLayout.gather(layout, values, fill=1))
    assert torch.equal(layout.scatter(packed), PositionLayout.scatter(layout, packed))
    assert torch.equal(layout.scatter(packed), torch.where(mask.bool(), values, torch.zeros_like(values)))


@pytest.mark.parametrize("kernel", [True, False])
def test_gaps(monkeypatch, kernel):
    if not kernel:
        monkeypatch.setattr(kernel_dispatch, "_OFF", {"mask_gaps"})
    for rows, gaps in (
        ([[1, 1, 0], [1, 0, 0], [0, 0, 0]], False),  # right-padded single turns, an empty row
        ([[1, 0, 1], [1, 1, 0]], True),  # a tool token inside
        ([[0, 1, 1], [1, 1, 0]], True),  # masked tokens before the first model token
    ):
        for dtype in (torch.bool, torch.int64, torch.float32):
            mask = torch.tensor(rows).to(dtype)
            assert has_gaps(mask) is gaps
            assert (position_layout(mask, "model") is None) is not gaps


def test_the_knobs_name_the_key():
    with pytest.raises(ValueError, match=r"algorithm.gtpo.position='column': must be one of \['model', 'raw', 'tu"):
        knob({"gtpo": {"position": "column"}}, "gtpo")
    with pytest.raises(ValueError, match=r"algorithm.gtpo_traj.position='turn': must be one of \['model', 'raw'\]"):
        knob({"gtpo_traj": {"position": "turn"}}, "gtpo_traj")
    with pytest.raises(ValueError, match="algorithm.gtpo.position='turn': conflict_mask=true needs position=model"):
        knob({"gtpo": {"position": "turn", "conflict_mask": True}}, "gtpo")
    assert knob({}, "gtpo").position == "model" and knob({}, "gtpo_traj").position == "model"


# ---------------------------------------------------------------------------------------------------------------------
# the invariants, for every estimator and position, kernel and definition


@pytest.mark.parametrize("setting", ESTIMATORS)
def test_tool_tokens_get_exactly_zero(setting, evaluation):
    check_tool_tokens_zero(advantages(setting, batch()), batch())


@pytest.mark.parametrize("setting", ESTIMATORS)
def test_tool_entropy_is_never_read(setting, evaluation):
    check_tool_entropy_unread(lambda b: advantages(setting, b), batch())


@pytest.mark.parametrize("setting", ["gtpo", "gtpo_turn", "gtpo_conflict_mask", "grpo_s", "gtpo_traj"])
def test_a_tool_output_of_1_or_500_tokens_leaves_the_model_tokens_alone(setting, evaluation):
    """Row 0 calls a tool whose output is 1 token, then 500; every model token's advantage is the same."""
    short = tool_batch([[3, 1, 4], *ROWS[1:]], REWARDS, GROUPS)
    long = tool_batch([[3, 500, 4], *ROWS[1:]], REWARDS, GROUPS)
    assert torch.equal(short.entropy[short.mask.bool()], long.entropy[long.mask.bool()])
    got_short, got_long = advantages(setting, short), advantages(setting, long)
    assert torch.equal(model_tokens(got_short, short), model_tokens(got_long, long))


def test_under_raw_the_length_of_a_tool_output_moves_credit():
    """The contrast: read as columns, the 500 tokens push row 0's second turn past every other row, where it meets
    no other correct response, so its shares change."""
    short = tool_batch([[3, 1, 4], *ROWS[1:]], REWARDS, GROUPS)
    long = tool_batch([[3, 500, 4], *ROWS[1:]], REWARDS, GROUPS)
    raw_short, raw_long = advantages("gtpo_raw", short), advantages("gtpo_raw", long)
    assert not torch.allclose(model_tokens(raw_short, short), model_tokens(raw_long, long))


@pytest.mark.parametrize("position", ["model", "raw", "turn"])
def test_conservation_holds_at_each_positions_own_positions(position, evaluation):
    """Prop. 2.2 at every position of the chosen reading, and only there (model index != column != turn index)."""
    b = batch()
    adv = advantages({"model": "gtpo", "raw": "gtpo_raw", "turn": "gtpo_turn"}[position], b)
    check_conservation(adv, b, position)
    for other in {"model", "raw", "turn"} - {position}:
        with pytest.raises(AssertionError, match="per-position means"):
            check_conservation(adv, b, other)


@pytest.mark.parametrize("position", ["model", "raw", "turn"])
def test_the_sign_of_correctness(position, evaluation):
    """zero_fill keeps the sign: every model token of a correct response above 0, of an incorrect one below."""
    b = batch()
    adv = advantages({"model": "gtpo", "raw": "gtpo_raw", "turn": "gtpo_turn"}[position], b)
    m = b.mask.bool()
    assert bool((adv[m & (b.rewards > 0)[:, None]] > 0).all())
    assert bool((adv[m & (b.rewards < 0)[:, None]] < 0).all())


@pytest.mark.parametrize("setting", ESTIMATORS)
def test_the_tokens_that_carry_gradient_are_grpos(setting, evaluation):
    subset = setting in ("gtpo_conflict_mask", "gtpo_traj", "gtpo_traj_raw", "gtpo_traj_code")
    check_gradient_tokens_match_grpo(advantages(setting, batch()), batch(), subset=subset)


def _built_anyway(mask, position, gaps=None):
    """The layout as if the mask had gaps (a single-turn batch then runs on a copy laid out by ``position``)."""
    return position_layout(mask, position, True if position != "raw" else gaps)


def _force_layouts(monkeypatch, layout=_built_anyway):
    """Every batch runs on its position's layout: the kernel reports gaps in its first pass, the layout is built."""
    original = kernels.gtpo_token_kernel

    def reporting(entropy, response_mask, correct, base, gid, num_groups, params, responses=None):
        if params.position != "raw":
            raise MaskGaps
        return original(entropy, response_mask, correct, base, gid, num_groups, params, responses)

    monkeypatch.setattr(kernels, "gtpo_token_kernel", reporting)
    monkeypatch.setattr(gtpo_token, "position_layout", layout)


def test_turn_reduces_to_the_single_turn_estimator_on_one_turn_responses(monkeypatch, evaluation):
    """One-turn responses: ``turn`` gives the single-turn estimator's advantages, also when its layout is built (the
    gap check forced on: the turn layout then runs the estimator on a copy)."""
    b = tool_batch([[n] for n in (3, 5, 1, 4, 2, 6, 4, 3)], REWARDS, GROUPS)
    single = gtpo_token_definition(b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOParams())[0]
    for forced in (False, True):
        if forced:
            _force_layouts(monkeypatch)
        for position in ("turn", "model"):
            params = GTPOParams(position=position)
            got = gtpo_token_advantages(b.entropy, b.mask, b.rewards, b.gid, b.num_groups, params)
            torch.testing.assert_close(got[0], single, rtol=1e-5, atol=1e-6)


def test_turn_compares_each_turn_with_the_same_turn_of_the_others():
    """``turn`` equals the definition run on a batch built by hand with each turn k in a block of its own."""
    b = tool_batch([[2, 1, 3], [1, 4, 2], [3], [2, 2, 1, 1, 1]], [1.0, 1.0, -1.0, -1.0], ["g"] * 4)
    # blocks: turn 0 is 3 wide (row 2), turn 1 is 3 wide (row 0), turn 2 is 1 wide (row 3)
    blocks = [[0, 1, None, 3, 4, 5, None], [0, None, None, 3, 4, None, None], [0, 1, 2, None, None, None, None],
              [0, 1, None, 3, None, None, 6]]  # fmt: skip
    entropy = torch.full((4, 7), math.nan)
    mask = torch.zeros(4, 7)
    for i, cols in enumerate(blocks):
        values = b.entropy[i][b.mask[i].bool()]
        placed = [c for c in cols if c is not None]
        entropy[i, placed] = values
        mask[i, placed] = 1
    ref = gtpo_token_definition(entropy, mask, b.rewards, b.gid, b.num_groups, GTPOParams())[0]
    got = gtpo_token_advantages(b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOParams(position="turn"))[0]
    torch.testing.assert_close(model_tokens(got, b), ref[mask.bool()], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", ["gtpo", "gtpo_turn", "gtpo_conflict_mask", "gtpo_traj"])
def test_kernel_and_definition_agree_on_every_layout(monkeypatch, setting):
    b = batch()
    kernel = advantages(setting, b)
    monkeypatch.setattr(kernel_dispatch, "_OFF", set(KERNELS))
    torch.testing.assert_close(kernel, advantages(setting, b), rtol=1e-5, atol=1e-6)


def test_traj_runs_pass_over_a_tool_output_under_model_and_stop_at_it_under_raw():
    """Two completions of opposite reward share ``0 1`` then a tool output then ``2``: under ``model`` the leading
    run covers all three model tokens (lambda+ = 2 on the positive one, lambda- = 0 on the negative one); under
    ``raw`` it ends at the tool output."""
    b = tool_batch([[2, 3, 2], [2, 3, 2]], [1.0, 0.0], ["g", "g"], model_entropy=[[0.1] * 4, [0.1] * 4])
    ids = torch.tensor([[0, 1, 9, 9, 9, 2, 3], [0, 1, 9, 9, 9, 2, 1]])
    params = dict(variant="code", tau=math.inf, divide_by_nconf=False, gamma=0.0)
    for position, shared in (("model", 3), ("raw", 2)):
        adv, _ = gtpo_traj.gtpo_traj_advantages(
            b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOTrajParams(**params, position=position),
            responses=ids,
        )  # fmt: skip
        positive, negative = (adv[i][b.mask[i].bool()] for i in (0, 1))
        assert positive[:shared].tolist() == [2 * float(positive[-1])] * shared, position
        assert negative[:shared].tolist() == [0.0] * shared, position
        assert float(negative[shared]) != 0.0, position


# ---------------------------------------------------------------------------------------------------------------------
# the same checks fail on a planted fault


def _neighbours_share(original):
    """Fault: a tool token takes the advantage of the model token before it."""

    def scatter(self, values):
        out = original(self, values)
        for row in range(out.shape[0]):
            cols = self.cols[self.rows == row].tolist()
            for a, b in zip(cols, cols[1:], strict=False):
                out[row, a + 1 : b] = out[row, a]
        return out

    return scatter


def _reads_masked_entropy(original):
    """Fault: the model token after a tool output reads the entropy of the tool token before it."""

    def gather(self, values, fill=0):
        out = original(self, values, fill)
        if values.is_floating_point():
            after_gap = torch.ones_like(self.cols, dtype=torch.bool)
            after_gap[1:] = (self.rows[1:] != self.rows[:-1]) | (self.cols[1:] != self.cols[:-1] + 1)
            after_gap &= self.cols > 0
            rows, cols, dest = self.rows[after_gap], self.cols[after_gap], self.dest[after_gap]
            out[rows, dest] = out[rows, dest] + 1e-3 * values[rows, cols - 1]
        return out

    return gather


class _ToolTokensAsModelTokens(PositionLayout):
    """Fault: the layout takes a tool output for model tokens, each with its neighbour's mask, entropy and id (so a
    share of its own)."""

    def gather(self, values, fill=0):
        filled = values.clone()
        for row, col in self.tool:
            filled[row, col] = filled[row, col - 1]
        return super().gather(filled, fill)


def _tool_tokens_as_model_tokens(mask, position, gaps=None):
    if position == "raw":
        return None
    inside = torch.cummax((mask != 0).flip(-1).long(), -1).values.flip(-1).bool()  # up to each row's last model token
    rows, cols = inside.nonzero(as_tuple=True)
    layout = _ToolTokensAsModelTokens(rows, cols, cols, tuple(mask.shape), mask.shape[1])
    object.__setattr__(layout, "tool", (inside & (mask == 0)).nonzero().tolist())
    return layout


def test_a_tool_token_given_its_neighbours_share_fails_the_checks(monkeypatch):
    for layout in (PositionLayout, CompactLayout):  # the index-based layout (turn) and the compiled one (model)
        monkeypatch.setattr(layout, "scatter", _neighbours_share(layout.scatter))
    b = batch()
    for setting in ("gtpo", "gtpo_turn", "gtpo_traj"):
        adv = advantages(setting, b)
        with pytest.raises(AssertionError, match="tool token"):
            check_tool_tokens_zero(adv, b)
        with pytest.raises(AssertionError, match="outside GRPO's gradient set"):
            check_gradient_tokens_match_grpo(adv, b)


def test_a_tool_token_counted_at_a_position_fails_conservation(monkeypatch):
    monkeypatch.setattr(gtpo_token, "position_layout", _tool_tokens_as_model_tokens)
    b = batch()
    adv = advantages("gtpo", b)
    with pytest.raises(AssertionError, match="per-position means"):
        check_conservation(adv, b, "model")
    with pytest.raises(AssertionError, match="tool token"):
        check_tool_tokens_zero(adv, b)


def test_masked_entropy_read_fails_the_check(monkeypatch):
    for layout in (PositionLayout, CompactLayout):
        monkeypatch.setattr(layout, "gather", _reads_masked_entropy(layout.gather))
    for setting in ("gtpo", "gtpo_turn", "gtpo_traj"):
        with pytest.raises((AssertionError, ValueError)):  # a changed advantage, or the NaN refused
            check_tool_entropy_unread(lambda b, setting=setting: advantages(setting, b), batch())


def test_a_model_index_that_counts_tool_tokens_fails_the_length_check(monkeypatch):
    """Fault: ``model`` positions taken as columns (the tool output counted)."""

    def columns(mask, position, gaps=None):
        layout = position_layout(mask, position, gaps)
        return None if layout is None else PositionLayout(layout.rows, layout.cols, layout.cols, layout.shape,
                                                          layout.shape[1])  # fmt: skip

    monkeypatch.setattr(gtpo_token, "position_layout", columns)
    short = tool_batch([[3, 1, 4], *ROWS[1:]], REWARDS, GROUPS)
    long = tool_batch([[3, 500, 4], *ROWS[1:]], REWARDS, GROUPS)
    assert not torch.equal(model_tokens(advantages("gtpo", short), short), model_tokens(advantages("gtpo", long), long))


def test_turn_blocks_aligned_at_the_turn_end_fail_the_one_turn_check(monkeypatch):
    """Fault: each turn right-aligned in its block; on one-turn responses of different lengths it differs from the
    single-turn estimator."""

    def right_aligned(mask, position, gaps=None):
        layout = _built_anyway(mask, position, gaps)
        if layout is None:  # the entry's own call on the layout (position=raw)
            return None
        rows, _, turn, offset = turn_index(mask)
        lengths = torch.bincount(rows, minlength=mask.shape[0])
        dest = layout.width - lengths[rows] + offset
        return PositionLayout(layout.rows, layout.cols, dest, layout.shape, layout.width)

    _force_layouts(monkeypatch, right_aligned)
    b = tool_batch([[n] for n in (3, 5, 1, 4, 2, 6, 4, 3)], REWARDS, GROUPS)
    single = gtpo_token_definition(b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOParams())[0]
    got = gtpo_token_advantages(b.entropy, b.mask, b.rewards, b.gid, b.num_groups, GTPOParams(position="turn"))[0]
    assert not torch.allclose(got, single, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# the step metrics of tool use


def test_tool_turn_metrics_by_hand():
    nan = math.nan
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 1]])
    entropy = torch.tensor(
        [[0.5, 1.0, 9.0, 9.0, 3.0, nan], [0.2, 0.4, 0.6, nan, nan, nan], [1.0, nan, 2.0, 1e9, 4.0, 0.5]]
    )
    got = tool_turn_metrics(mask, entropy)
    # row 0: one tool output; row 1: none; row 2: two. 4 masked tokens among the 5 + 3 + 6 tokens up to the last
    # model token of each row. After a tool output: 3.0, 2.0, 4.0; the 7 other model tokens sum to 4.2.
    assert got == pytest.approx(
        {
            "tool_outputs_per_response": 1.0,
            "tool_response_frac": 2 / 3,
            "masked_token_frac": 4 / 14,
            "entropy_after_tool_mean": 3.0,
            "entropy_other_mean": 0.6,
        }
    )
    single = tool_turn_metrics(mask[1:2], entropy[1:2])
    assert single == pytest.approx(
        {"tool_outputs_per_response": 0.0, "tool_response_frac": 0.0, "masked_token_frac": 0.0,
         "entropy_other_mean": 0.4}
    )  # fmt: skip
    # masked tokens before the first model token are no tool output
    leading = tool_turn_metrics(torch.tensor([[0, 1, 1]]), torch.tensor([[nan, 1.0, 2.0]]))
    assert leading["tool_outputs_per_response"] == 0 and "entropy_after_tool_mean" not in leading
