"""gtpo/launch/batch_checks.py: verl's batch arithmetic at config time (data-parallel ranks = world / Ulysses size,
the trainer's padding to an lcm, per-role log-prob shares, token budgets), each case computed by hand.

    .venv/bin/python -m pytest -q tests/test_batch_checks.py

backend=cpu_tiny gives rollout.n=4, data.train_batch_size=2, ppo_mini_batch_size=2 (8 responses per mini-batch),
one rank, dynamic batch sizes with budgets 256 / 512 / 512 and prompt 128 + response 16 = 144 tokens.
"""

from __future__ import annotations

import pytest

from gtpo.launch.batch_checks import batch_plan
from tests.support.configs import compose

ARR = "actor_rollout_ref"
# fixed micro-batches in every pass (the rollout's log-prob flag follows the actor's)
STATIC = [f"{ARR}.actor.use_dynamic_bsz=false", f"{ARR}.ref.log_prob_use_dynamic_bsz=false"]
KL = [f"{ARR}.actor.use_kl_loss=true"]


def _check(*overrides: str) -> None:
    batch_plan(compose(["backend=cpu_tiny", *overrides]))


def test_log_prob_rows_are_padded_to_the_lcm_not_the_product():
    # 6 prompts x 4 = 24 rows; lcm(2 ranks, 8-row mini-batch) = 8 -> 24 rows, 12 per rank (the product 16 would
    # pad to 32, 16 per rank, which 12 does not divide)
    two = ["trainer.n_gpus_per_node=2", "data.train_batch_size=6", *STATIC]
    _check(*two, f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=12")
    with pytest.raises(ValueError, match=r"=8 does not divide the 12 responses each rank gets .*24 responses, padded"):
        _check(*two, f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=8")


def test_a_mini_batch_counts_prompts_times_rollout_n():
    # 1 prompt x 4 = 4 responses per mini-batch, 2 per rank: a micro-batch of 2 is one pass, 4 is refused
    one = ["trainer.n_gpus_per_node=2", f"{ARR}.actor.ppo_mini_batch_size=1", *STATIC]
    _check(*one, f"{ARR}.actor.ppo_micro_batch_size_per_gpu=2")
    with pytest.raises(ValueError, match=r"ppo_micro_batch_size_per_gpu=4 does not divide the 2 responses each rank"):
        _check(*one, f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4")


def test_separate_async_computes_each_slice_of_the_step_on_its_own():
    # 4 prompts in 2 slices of 2 x 4 = 8 rows; lcm(2, 8) = 8 -> 4 per rank: 8 does not divide (one slice of 16 rows,
    # a mini-batch of 4 prompts, would: 8)
    mode = ["trainer.v1.trainer_mode=gtpo_separate_async", "data.train_batch_size=4", "trainer.n_gpus_per_node=2",
            f"{ARR}.rollout.nnodes=1", f"{ARR}.rollout.n_gpus_per_node=1"]  # fmt: skip
    micro = [*STATIC, f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=8"]
    with pytest.raises(ValueError, match=r"=8 does not divide the 4 responses each rank gets of the old-policy log"):
        _check(*mode, "trainer.v1.separate_async.parameter_sync_step=2", *micro)
    _check(*mode, "trainer.v1.separate_async.parameter_sync_step=1", f"{ARR}.actor.ppo_mini_batch_size=4", *micro)


def test_the_reference_pass_is_checked_when_a_kl_term_needs_it():
    ref = [*STATIC, f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=7"]
    _check(*ref)  # no KL term: no reference model
    with pytest.raises(ValueError, match=r"ref.log_prob_micro_batch_size_per_gpu=7 does not divide the 8 responses"):
        _check(*ref, *KL)
    _check(*ref, *KL, f"{ARR}.model.lora_rank=8")  # LoRA: the actor's engine without the adapter is the reference


def test_dynamic_log_probs_on_the_rollout_leave_the_reference_pass_fixed():
    # actor and rollout cut by tokens (verl requires both flags equal), the reference pass by 7 rows of 8
    ref = [f"{ARR}.ref.log_prob_use_dynamic_bsz=false", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=7", *KL]
    with pytest.raises(ValueError, match=r"ref.log_prob_micro_batch_size_per_gpu=7 does not divide the 8 responses"):
        _check(f"{ARR}.rollout.log_prob_use_dynamic_bsz=true", *ref)
    with pytest.raises(ValueError, match=r"rollout.log_prob_use_dynamic_bsz=True must equal .*use_dynamic_bsz=False"):
        _check(f"{ARR}.actor.use_dynamic_bsz=false", f"{ARR}.rollout.log_prob_use_dynamic_bsz=true")


def test_ulysses_divides_the_world_into_data_parallel_ranks():
    # 4 ranks, Ulysses 2 -> 2 data-parallel ranks: 8 responses per mini-batch, 4 per rank (2 per rank at world 4)
    sp2 = ["trainer.n_gpus_per_node=4", f"{ARR}.actor.ulysses_sequence_parallel_size=2", *STATIC]
    _check(*sp2, f"{ARR}.actor.ppo_micro_batch_size_per_gpu=4", f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=4")
    with pytest.raises(ValueError, match=r"=3 does not divide the 4 responses .*2 data-parallel ranks \(world 4 / Ul"):
        _check(*sp2, f"{ARR}.actor.ppo_micro_batch_size_per_gpu=3")
    # the reverse: a reference model without Ulysses splits the 8 rows over all 4 ranks, 2 each: 4 does not divide
    ref = [*KL, f"{ARR}.ref.ulysses_sequence_parallel_size=1", f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=4"]
    with pytest.raises(ValueError, match=r"ref.+=4 does not divide the 2 responses .*4 data-parallel ranks \(world 4 "):
        _check(*sp2, *ref)
    _check(*sp2, *KL, f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=4")  # the reference inherits Ulysses 2


def test_a_ulysses_size_that_does_not_divide_the_world_is_refused():
    four = ["trainer.n_gpus_per_node=4"]
    with pytest.raises(
        ValueError, match=r"actor.ulysses_sequence_parallel_size=3 does not divide the world size .* = 4"
    ):
        _check(*four, f"{ARR}.actor.ulysses_sequence_parallel_size=3")
    with pytest.raises(ValueError, match=r"actor.fsdp_config.ulysses_sequence_parallel_size=3 does not divide"):
        _check(*four, f"{ARR}.actor.fsdp_config.ulysses_sequence_parallel_size=3")
    with pytest.raises(ValueError, match=r"ref.ulysses_sequence_parallel_size=3 does not divide the world size"):
        _check(*four, *KL, f"{ARR}.ref.ulysses_sequence_parallel_size=3")
    with pytest.raises(ValueError, match=r"8 responses per mini-batch do not split evenly over .*: 3 data-parallel"):
        _check("trainer.n_gpus_per_node=3")


def test_uneven_reference_shares_are_each_checked():
    # actor Ulysses 4 on 4 ranks (1 dp rank), reference without: 2 prompts x 3 = 6 rows (lcm(1, 3) = 3) over 4
    # reference ranks: 2, 2, 1, 1
    uneven = ["trainer.n_gpus_per_node=4", f"{ARR}.rollout.n=3", f"{ARR}.actor.ppo_mini_batch_size=1", *STATIC, *KL]
    sp = [f"{ARR}.actor.ulysses_sequence_parallel_size=4", f"{ARR}.ref.ulysses_sequence_parallel_size=1"]
    with pytest.raises(ValueError, match=r"=2 does not divide the 1 responses some ranks get .*divisor of 1 or"):
        _check(*uneven, *sp, f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=2")
    _check(*uneven, *sp, f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=1")


@pytest.mark.parametrize(
    "key,extra",
    [("actor.ppo_max_token_len_per_gpu", []), ("rollout.log_prob_max_token_len_per_gpu", []),
     ("ref.log_prob_max_token_len_per_gpu", KL)],
)  # fmt: skip
def test_a_token_budget_must_hold_one_full_prompt_and_response(key, extra):
    sequence = r"data.max_prompt_length=128 \+ data.max_response_length=16 = 144 tokens"
    with pytest.raises(ValueError, match=rf"{ARR}.{key}=143: a micro-batch holds 143 x Ulysses 1 = 143 .*{sequence}"):
        _check(*extra, f"{ARR}.{key}=143")
    _check(*extra, f"{ARR}.{key}=144")
    _check(*STATIC, *extra, f"{ARR}.{key}=1")  # fixed micro-batches: no budget


def test_a_token_budget_counts_ulysses_and_its_own_switch():
    # Ulysses 2: 72 tokens per GPU hold 144 per micro-batch, 71 hold 142
    sp2 = ["trainer.n_gpus_per_node=4", f"{ARR}.actor.ulysses_sequence_parallel_size=2"]
    _check(*sp2, f"{ARR}.actor.ppo_max_token_len_per_gpu=72")
    with pytest.raises(ValueError, match=r"=71: a micro-batch holds 71 x Ulysses 2 = 142 tokens.*at least 72"):
        _check(*sp2, f"{ARR}.actor.ppo_max_token_len_per_gpu=71")
    # the reference pass with fixed micro-batches, the others by tokens; no reference model without a KL term
    _check(*KL, f"{ARR}.ref.log_prob_use_dynamic_bsz=false", f"{ARR}.ref.log_prob_max_token_len_per_gpu=1")
    _check(f"{ARR}.ref.log_prob_max_token_len_per_gpu=1")


def test_a_critic_mini_batch_joins_the_padding_multiple():
    # GAE: 2 ranks, critic mini-batch 3 x 4 = 12 rows: 8 responses padded to lcm(2, 12, 8) = 24, 12 per rank (without
    # the critic: 8, 4 per rank); during the critic's warm-up steps to lcm(2, 12) = 12, 6 per rank
    gae = ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3", "trainer.n_gpus_per_node=2", *STATIC]
    _check(*gae, f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=12")
    with pytest.raises(ValueError, match=r"=12 does not divide the 6 responses .*lcm\(2, 12\) during trainer.critic"):
        _check(*gae, "trainer.critic_warmup=1", f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=12")


def test_a_token_budget_must_hold_verl_s_128_token_padding_row():
    """verl pads a short batch with 128-token rows (failed sessions, dynamic sampling): a budget below that stops in
    the workers the first time it happens, whatever the run's own lengths."""
    from tests.support.configs import compose

    short = ["backend=cpu_tiny", "data.max_prompt_length=8", "data.max_response_length=4"]
    batch_plan(compose([*short, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128"]))
    with pytest.raises(ValueError, match=r"ppo_max_token_len_per_gpu=127: .* less than the 128-token padding row"):
        batch_plan(compose([*short, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=127"]))
    ulysses = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    batch_plan(compose([*short, *ulysses, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"]))


def test_the_old_policy_pass_shares_the_actors_dynamic_batching_when_unset():
    """verl's composed config always sets ``rollout.log_prob_use_dynamic_bsz`` by interpolation; a hand-built one
    without it takes the actor's flag (verl's actor worker asserts the two equal)."""
    from omegaconf import OmegaConf

    from gtpo.launch.batch_checks import dynamic_batches

    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_dynamic_bsz": True}, "rollout": {}}})
    assert dynamic_batches(config) is True


def test_a_lora_adapter_path_puts_the_reference_pass_on_the_actors_engine():
    """With adapters loaded from a path the reference model is the actor's base (verl's ``ref_in_actor``): a fixed
    reference micro-batch is checked against the actor's ranks, not refused as if on an engine of its own."""
    from gtpo.launch.batch_checks import engines

    cfg = compose(["backend=cpu_tiny", "actor_rollout_ref.actor.use_kl_loss=true",
                   "actor_rollout_ref.model.lora_adapter_path=/models/adapter"])  # fmt: skip
    assert engines(cfg) == {"rollout": "actor", "ref": "actor"}
    assert engines(compose(["backend=cpu_tiny", "actor_rollout_ref.actor.use_kl_loss=true"]))["ref"] == "ref"
