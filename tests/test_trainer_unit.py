"""The gtpo_sync trainer's own logic, without Ray: its mode, its replay buffer, and its advantage step.

The same logic on the two asynchronous trainers: tests/test_async_trainers.py.

.venv/bin/python -m pytest -q tests/test_trainer_unit.py
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.support.configs import compose


def make_trainer(overrides: list[str]):
    """A GTPOTrainerSync with its config set but no workers (enough for the replay buffer and the mode)."""
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.trainer.modes import GTPOTrainerSync

    trainer = GTPOTrainerSync.__new__(GTPOTrainerSync)
    trainer.config = compose(overrides)
    OmegaConf.resolve(trainer.config)
    trainer.trainer_mode = trainer.config.trainer.v1.trainer_mode
    return trainer


def test_registered_under_its_own_name_but_runs_as_sync():
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = make_trainer([])
    assert get_trainer_cls("gtpo_sync") is type(trainer)
    assert isinstance(trainer, PPOTrainerSync)
    # verl's base class branches on the literal "sync" (replay buffer class, dataloader refill, checkpoints).
    assert trainer.trainer_mode == "sync"
    with pytest.raises(ValueError, match="trainer_mode='colocate_async'"):
        trainer.trainer_mode = "colocate_async"


def test_replay_buffer_is_verl_sync_buffer_with_dapo_settings():
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

    from gtpo.trainer.dynamic_sampling import BoundedDapoReplayBuffer

    plain = make_trainer(["method=gtpo", "algorithm.filter_groups.enable=false"])._build_replay_buffer()
    assert type(plain) is ReplayBuffer and not isinstance(plain, ReplayBufferAsync)
    assert plain.poll_interval == 2.0 and plain.filter_groups_metric is None

    dapo = make_trainer(["method=dapo", "backend=cpu_tiny"])._build_replay_buffer()
    assert isinstance(dapo, BoundedDapoReplayBuffer)
    assert dapo.filter_groups_metric == "acc" and dapo.max_num_gen_batches == 10
    # the CPU preset's faster poll survives the round-limit wrapper
    assert dapo.poll_interval == 0.05


def test_bad_poll_interval_is_rejected():
    trainer = make_trainer(["backend=cpu_tiny", "trainer.v1.sampler.sampler_kwargs.poll_interval=0"])
    with pytest.raises(ValueError, match=r"poll_interval=0"):
        trainer._build_replay_buffer()


def test_advantage_step_feeds_entropy_and_tokens_and_skips_padding_rows():
    """The recipe path: the estimator gets entropy, token ids and a metrics dict; verl's padding rows stay out."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    trainer = make_trainer(["method=gtpo", "algorithm.gtpo.conflict_mask=true"])
    trainer.global_steps = 3
    gen = torch.Generator().manual_seed(0)
    rows, length = 9, 6
    mask = (torch.arange(length)[None, :] < torch.tensor([6, 3, 5, 6, 2, 4, 6, 6, 1])[:, None]).float()
    mask[-1] = 0.0  # verl's synthetic padding row has an all-zero response mask
    rewards = torch.zeros(rows, length)
    last = (mask.sum(-1) - 1).clamp(min=0).long()
    rewards[torch.arange(rows), last] = torch.tensor([1.0, -1, 1, -1, -1, 1, 1, -1, 0.0])
    entropy = torch.rand(rows, length, generator=gen) * 3 + 0.1
    responses = torch.randint(0, 4, (rows, length), generator=gen)
    uid = np.array(["a", "b", "a", "b", "a", "b", "c", "c", "pad"], dtype=object)
    data = DataProto(
        batch=TensorDict(
            {"token_level_rewards": rewards, "response_mask": mask, "entropy": entropy, "responses": responses},
            batch_size=rows,
        ),
        non_tensor_batch={"uid": uid},
    )
    batch = SimpleNamespace(tags=[{}] * (rows - 1) + [{"is_padding": True}])
    metrics: dict = {}
    advantages, returns = trainer._recipe_advantages(data, batch, metrics)

    expected_metrics: dict = {}
    expected, _ = get_adv_estimator_fn("gtpo")(
        token_level_rewards=rewards[:-1],
        response_mask=mask[:-1],
        index=uid[:-1],
        config=trainer.config.algorithm,
        entropy=entropy[:-1],
        responses=responses[:-1],
        metrics=expected_metrics,
    )
    torch.testing.assert_close(advantages[:-1], expected)
    assert torch.count_nonzero(advantages[-1]) == 0 and torch.count_nonzero(returns[-1]) == 0
    assert torch.count_nonzero(advantages * (1 - mask)) == 0, "padding positions must stay zero"
    # what this call saw: the 8 real rows of groups a, b, c (the padding row and its "pad" uid stay out)
    seen = {k: metrics.pop(k) for k in ("gtpo/estimator_rows", "gtpo/estimator_groups", "gtpo/estimator_calls_total")}
    assert seen == {"gtpo/estimator_rows": 8.0, "gtpo/estimator_groups": 3.0, "gtpo/estimator_calls_total": 1.0}
    # groups of 3, 3 and 2 responses, all short of rollout.n
    n = trainer.config.actor_rollout_ref.rollout.n
    assert n > 3 and metrics.pop("gtpo/min_group_size") == 2.0 and metrics.pop("gtpo/short_groups_total") == 3.0
    # the kernel's compile time is logged by the first call of the process only
    metrics.pop("gtpo/kernel_compile_s", None)
    expected_metrics.pop("gtpo/kernel_compile_s", None)
    assert metrics == expected_metrics
    assert "gtpo/conflict_token_frac" in metrics and metrics["gtpo/frac_groups_all_wrong"] == 0.0


def test_advantage_step_keeps_h_ini_in_each_trainers_own_state():
    """gtpo_traj's ini gate measures ``<H>_ini`` into the state of the trainer whose step ran: two trainers in one
    process measure their own first batches (mean entropy 0.5 and 1.25 on every token) and keep them."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

    def step(trainer, entropy: float) -> dict:
        mask = torch.ones(4, 3)
        rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
        fields = {"token_level_rewards": rewards, "response_mask": mask, "entropy": torch.full((4, 3), entropy)}
        fields["responses"] = torch.tensor([[1, 2, 3], [1, 2, 4], [5, 6, 7], [5, 6, 8]])
        uid = np.array(["a", "a", "b", "b"], dtype=object)
        data = DataProto(batch=TensorDict(fields, batch_size=4), non_tensor_batch={"uid": uid})
        metrics: dict = {}
        trainer._recipe_advantages(data, SimpleNamespace(tags=[{}] * 4), metrics)
        return metrics

    overrides = ["method=gtpo_traj", "algorithm.gtpo_traj.variant=paper", "actor_rollout_ref.rollout.n=2"]
    first, second = make_trainer(overrides), make_trainer(overrides)
    first.global_steps = second.global_steps = 1
    assert step(first, 0.5)["gtpo_traj/h_ini"] == 0.5
    assert step(second, 1.25)["gtpo_traj/h_ini"] == 1.25
    first.global_steps = 2
    assert step(first, 3.0)["gtpo_traj/h_ini"] == 0.5  # measured once: a later batch does not re-measure
    assert first.recipe_state == {"gtpo_traj": {"h_ini": 0.5}}
    assert second.recipe_state == {"gtpo_traj": {"h_ini": 1.25}}


@pytest.mark.parametrize("multi_turn", [True, False])
def test_advantage_step_logs_what_the_tool_turns_did(multi_turn):
    """With ``multi_turn.enable`` the step logs the tool turns' metrics under the estimator's prefix, computed on the
    real rows (verl's padding row left out); single-turn runs log none of them."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

    from gtpo.algorithms.token_positions import tool_turn_metrics

    trainer = make_trainer(["method=gtpo", f"actor_rollout_ref.rollout.multi_turn.enable={multi_turn}"])
    trainer.global_steps = 1
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0.0]])
    rewards = torch.zeros(5, 5)
    rewards[torch.arange(4), torch.tensor([4, 2, 4, 3])] = torch.tensor([1.0, -1.0, -1.0, 1.0])
    entropy = torch.tensor([[0.5, 1.0, 7.0, 7.0, 3.0], [0.2, 0.4, 0.6, 0, 0], [1.0, 7.0, 2.0, 0.3, 0.2], [1.0] * 5,
                            [50.0] * 5])  # fmt: skip
    fields = {"token_level_rewards": rewards, "response_mask": mask, "entropy": entropy}
    uid = np.array(["a", "a", "b", "b", "pad"], dtype=object)
    data = DataProto(batch=TensorDict(fields, batch_size=5), non_tensor_batch={"uid": uid})
    metrics: dict = {}
    trainer._recipe_advantages(data, SimpleNamespace(tags=[{}] * 4 + [{"is_padding": True}]), metrics)
    logged = {key: value for key, value in metrics.items() if key.startswith("gtpo/") and "tool" in key}
    if not multi_turn:
        assert logged == {} and "gtpo/entropy_other_mean" not in metrics
        return
    expected = tool_turn_metrics(mask[:4], entropy[:4])
    assert expected["tool_outputs_per_response"] == 0.5 and expected["entropy_after_tool_mean"] == 2.5
    assert {key: metrics[f"gtpo/{key}"] for key in expected} == expected
