"""DAPO pieces: verl's overlong reward shaping and dynamic sampling checked against DAPO's formulas.

Run: cd /work/main && .venv/bin/pytest -q tests/test_dapo.py

verl 0.9.1's own mechanisms are exercised directly (the reward-loop ``DAPORewardManager`` on a tiny batch; the v1
sync ``ReplayBuffer`` over an in-memory stand-in of TransferQueue), plus the recipe's generation-round limit.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from gtpo.algorithms.dapo import mixed_groups, overlong_reward

L_MAX, L_CACHE = 16, 4


# --------------------------------------------------------------------------------------------------- overlong


def test_overlong_formula_at_the_boundaries():
    lengths = torch.tensor([0, L_MAX - L_CACHE, L_MAX - L_CACHE + 1, L_MAX - 1, L_MAX, L_MAX + 1, 10 * L_MAX])
    got = overlong_reward(lengths, L_MAX, L_CACHE)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0])
    assert overlong_reward(torch.tensor([14]), L_MAX, L_CACHE, penalty_factor=2.0).item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_reward(lengths, 4, 8)


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def _verl_dapo_reward(length: int, width: int, score: float = 1.0):
    """Run verl's reward-loop DAPORewardManager.run_single on one response of ``length`` tokens."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls

    config = OmegaConf.create(
        {
            "reward": {
                "reward_kwargs": {
                    "overlong_buffer_cfg": {"enable": True, "len": L_CACHE, "penalty_factor": 1.0, "log": True},
                    "max_resp_len": L_MAX,
                }
            }
        }
    )

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": score, "acc": float(score > 0)}

    manager = get_reward_manager_cls("dapo")(config, _Tok(), compute_score)
    prompt_len = 3
    attention = torch.zeros(1, prompt_len + width, dtype=torch.long)
    attention[0, : prompt_len + length] = 1
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(1, prompt_len, dtype=torch.long),
            "responses": torch.arange(width, dtype=torch.long)[None],
            "attention_mask": attention,
        },
        non_tensors={
            "data_source": np.array(["math"], dtype=object),
            "reward_model": np.array([{"ground_truth": "1"}], dtype=object),
            "extra_info": np.array([{}], dtype=object),
        },
    )
    return manager.loop.run_until_complete(manager.run_single(data))


def test_verl_dapo_reward_manager_matches_formula():
    for length in (1, L_MAX - L_CACHE, L_MAX - L_CACHE + 1, L_MAX - 1, L_MAX):
        out = _verl_dapo_reward(length, width=L_MAX)
        expected = overlong_reward(torch.tensor([length]), L_MAX, L_CACHE).item()
        assert out["reward_score"] - 1.0 == pytest.approx(expected), length
        assert out["reward_extra_info"]["overlong_reward"] == pytest.approx(expected)
        assert out["reward_extra_info"]["acc"] == 1.0  # the filter metric stays the unshaped accuracy


def test_verl_dapo_reward_manager_beyond_max_is_unclamped():
    """Documented difference: verl does not clamp at -1 past L_max (unreachable when max_resp_len equals the
    rollout's response_length, since generation stops there)."""
    out = _verl_dapo_reward(L_MAX + 2, width=L_MAX + 2)
    assert out["reward_score"] - 1.0 == pytest.approx(-(L_CACHE + 2) / L_CACHE)
    assert overlong_reward(torch.tensor([L_MAX + 2]), L_MAX, L_CACHE).item() == -1.0


# ------------------------------------------------------------------------------------------ dynamic sampling


def test_mixed_groups_keep_rule():
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    gid = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert mixed_groups(acc, gid, 4).tolist() == [True, False, False, False]


class _FakeTQ:
    """In-memory stand-in for the three TransferQueue calls the sync ReplayBuffer makes."""

    def __init__(self):
        self.tags: dict[str, dict] = {}
        self.fields: dict[str, dict] = {}

    def kv_list(self):
        return {"train": dict(self.tags)} if self.tags else None

    def kv_batch_get(self, keys, partition_id, select_fields):
        assert select_fields == ["extra_fields"]
        return {"extra_fields": [self.fields[k] for k in keys]}

    def kv_clear(self, partition_id, keys):
        for k in keys:
            self.tags.pop(k, None)
            self.fields.pop(k, None)


class _Rollout:
    """Instant 'generation': each new prompt finishes with the next scripted group of accuracies."""

    def __init__(self, tq, outcomes, limit=10_000):
        self.tq, self.outcomes, self.next_uid, self.dispatched, self.limit = tq, deque(outcomes), 0, 0, limit
        self.acc: dict[str, float] = {}  # permanent record: the buffer clears evicted groups from the store

    def submit(self, num_prompts):
        self.dispatched += num_prompts
        if self.dispatched > self.limit:
            raise OverflowError(f"dispatched {self.dispatched} prompts")
        for _ in range(num_prompts):
            uid = f"u{self.next_uid}"
            self.next_uid += 1
            accs = self.outcomes.popleft() if self.outcomes else [1.0, 1.0]
            self.tq.tags[uid] = {"is_prompt": True, "status": "finished", "global_steps": 1}
            for s, acc in enumerate(accs):
                key = f"{uid}_{s}_0"
                self.tq.tags[key] = {"status": "success"}
                self.tq.fields[key] = {"reward_extra_info": {"acc": acc}}
                self.acc[key] = acc
        return num_prompts


def _buffer(monkeypatch, outcomes, cls=None, limit=10_000, **kwargs):
    from verl.trainer.ppo.v1 import replay_buffer as rb

    tq = _FakeTQ()
    monkeypatch.setattr(rb, "tq", tq)
    rollout = _Rollout(tq, outcomes, limit)
    cls = cls or rb.ReplayBuffer
    buffer = cls(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=0.0,
        refill_fn=rollout.submit,
        filter_groups_metric="acc",
        train_batch_size=4,
        gen_batch_size=1,
        max_inflight_gen_batches=1,
        **kwargs,
    )
    return buffer, rollout, tq


MIXED, ALL_RIGHT, ALL_WRONG = [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]


def _selected_groups(batch, acc):
    uids = sorted({k.split("_")[0] for k in batch.keys})
    return uids, [[acc[k] for k in batch.keys if k.startswith(u + "_")] for u in uids]


def test_verl_sync_replay_buffer_fills_batch_with_mixed_groups(monkeypatch):
    outcomes = [MIXED, ALL_RIGHT, MIXED, ALL_WRONG] + [ALL_RIGHT, MIXED, MIXED, ALL_WRONG, MIXED, MIXED]
    buffer, rollout, tq = _buffer(monkeypatch, outcomes)
    rollout.submit(4)  # the step's first generation batch (prepare_step)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    uids, accs = _selected_groups(batch, rollout.acc)
    assert len(uids) == 4
    for group in accs:
        assert 0.0 < float(np.mean(group)) < 1.0  # neither all 0 nor all 1
    assert metrics["training/filter_groups/evicted_samples"] >= 2
    # verl refills 2k prompts per k evictions (speculatively) and discards the surplus.
    assert rollout.dispatched > 4


def test_verl_ignores_max_num_gen_batches(monkeypatch):
    """verl 0.9.1 has no round limit: with saturated groups it keeps refilling (stopped here by the fake)."""
    buffer, rollout, _ = _buffer(monkeypatch, [], limit=40)
    rollout.submit(4)
    with pytest.raises(OverflowError):
        buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    assert rollout.dispatched > 40


def test_round_limit_stops_after_max_num_gen_batches(monkeypatch):
    from gtpo.trainer.dynamic_sampling import BoundedDapoReplayBuffer

    buffer, rollout, _ = _buffer(monkeypatch, [], cls=BoundedDapoReplayBuffer, max_num_gen_batches=3)
    rollout.submit(4)
    with pytest.raises(RuntimeError, match="max_num_gen_batches=3"):
        buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    # Round 1 = the step's 4 prompts, rounds 2-3 = at most 2 * train_batch_size replacement prompts.
    assert rollout.dispatched == 4 + 2 * 4


def test_round_limit_lets_a_fillable_batch_through(monkeypatch):
    from gtpo.trainer.dynamic_sampling import ROUNDS_METRIC, BoundedDapoReplayBuffer

    outcomes = [MIXED, ALL_RIGHT, MIXED, ALL_WRONG, MIXED, MIXED, ALL_RIGHT, ALL_RIGHT]
    buffer, rollout, _ = _buffer(monkeypatch, outcomes, cls=BoundedDapoReplayBuffer, max_num_gen_batches=2)
    rollout.submit(4)
    batch, metrics = buffer.sample(global_steps=1, partition_id="train", batch_size=4)
    uids, accs = _selected_groups(batch, rollout.acc)
    assert len(uids) == 4 and all(0.0 < float(np.mean(g)) < 1.0 for g in accs)
    assert 1.0 < metrics[ROUNDS_METRIC] <= 2.0
    assert rollout.dispatched <= 4 + 4


def test_bound_generation_rounds_wraps_only_when_configured(monkeypatch):
    from omegaconf import OmegaConf

    from gtpo.trainer.dynamic_sampling import BoundedDapoReplayBuffer, bound_generation_rounds

    buffer, rollout, _ = _buffer(monkeypatch, [])
    off = OmegaConf.create({"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 0}})
    assert bound_generation_rounds(buffer, off) is buffer
    on = OmegaConf.create({"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 5}})
    bounded = bound_generation_rounds(buffer, on)
    assert isinstance(bounded, BoundedDapoReplayBuffer) and bounded.max_num_gen_batches == 5
    assert bounded.filter_groups_metric == "acc" and bounded.train_batch_size == 4
    with pytest.raises(ValueError, match="sync ReplayBuffer"):
        BoundedDapoReplayBuffer.from_replay_buffer(bounded, 5)


@pytest.mark.parametrize("method", ["gtpo", "grpo_s"])
def test_gtpo_and_grpo_s_presets_stop_at_dapo_s_round_limit(monkeypatch, method):
    """Their dynamic sampling gets DAPO's bound: 10 generation rounds, then an error naming the limit."""
    from gtpo.trainer.dynamic_sampling import BoundedDapoReplayBuffer, bound_generation_rounds
    from tests.support.configs import compose

    algorithm = compose([f"method={method}"]).algorithm
    buffer, rollout, _ = _buffer(monkeypatch, [])  # every group saturated: the batch never fills
    bounded = bound_generation_rounds(buffer, algorithm)
    assert isinstance(bounded, BoundedDapoReplayBuffer) and bounded.max_num_gen_batches == 10
    rollout.submit(4)
    with pytest.raises(RuntimeError, match=r"algorithm\.filter_groups\.max_num_gen_batches=10 generation rounds"):
        bounded.sample(global_steps=1, partition_id="train", batch_size=4)
    assert rollout.dispatched == 4 + 9 * 4
