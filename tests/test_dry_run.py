"""gtpo/verl_plugin/dry_run.py: every batch-arithmetic and registry check fails with the offending key named.

    .venv/bin/pytest -q tests/test_dry_run.py

Composes the recipe config in-process (Hydra compose API, CWD = repository root) with the shipped presets and
breaks one value per case; the unbroken 7B and 32B configs must pass. Nothing here starts Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not (REPO / "configs/method/gtpo.yaml").is_file() or not (REPO / "recipe/gtpo/config/gtpo_trainer.yaml").is_file(),
    reason="recipe config or the gtpo method preset does not exist yet",
)


@pytest.fixture
def compose(monkeypatch):
    import verl  # noqa: F401  (loads the plugin through VERL_USE_EXTERNAL_MODULES / entry points)

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.verl_plugin.dry_run import compose_config

    monkeypatch.chdir(REPO)
    return lambda *overrides: compose_config(["method=gtpo", *overrides])


@pytest.mark.parametrize("size", ["7b", "32b"])
def test_presets_pass(compose, capsys, size):
    from gtpo.verl_plugin.dry_run import BEGIN_MARK, END_MARK, run_dry

    run_dry(compose(f"model=qwen2.5_{size}"))
    out = capsys.readouterr().out
    assert BEGIN_MARK in out and END_MARK in out and "[dry run] OK" in out


def test_batch_plan_numbers(compose):
    from omegaconf import OmegaConf

    from gtpo.verl_plugin.dry_run import batch_plan

    cfg = compose("model=qwen2.5_32b")
    OmegaConf.resolve(cfg)
    plan = batch_plan(cfg)
    # 4 x 8 GPUs, Ulysses 8 -> dp 4; TP 4 -> 8 vLLM replicas; 512 x 16 sequences in 16 mini-batches of 32 x 16 / 4.
    assert plan == {
        "n_gpus": 32,
        "sp": 8,
        "dp": 4,
        "rollout_replicas": 8,
        "max_seq_len": 22528,
        "sequences_per_step": 8192,
        "mini_batches_per_step": 16,
        "sequences_per_rank_per_mini_batch": 128,
        "dynamic_bsz": True,
    }


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"],
            r"ulysses_sequence_parallel_size=3 does not divide",
        ),
        (["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2000"], r"ppo_max_token_len_per_gpu=2000 \* ulysses"),
        (
            ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2000"],
            r"rollout.log_prob_max_token_len_per_gpu=2000",
        ),
        (["actor_rollout_ref.rollout.n=1"], r"rollout.n=1: algorithm.adv_estimator=gtpo"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], r"replica size .* = 3 must tile"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=30"], r"train_batch_size=512 must be a multiple of .*=30"),
        (["trainer.nnodes=3"], r"32 \* 16 = 512 sequences do not split evenly over 3 data-parallel ranks"),
        (["data.max_response_length=200000"], r"= 2048 \+ 200000 = 202048: one full sequence must fit"),
        (["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], r"gpu_memory_utilization=1.5"),
        (["algorithm.adv_estimator=no_such_estimator"], r"adv_estimator=no_such_estimator: not registered"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=no_such_loss"], r"loss_mode=no_such_loss: not registered"),
        (["trainer.v1.trainer_mode=no_such_mode"], r"trainer_mode=no_such_mode: not registered"),
        (
            [
                "actor_rollout_ref.actor.use_dynamic_bsz=false",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
            ],
            r"ppo_micro_batch_size_per_gpu=None must be set",
        ),
        (["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"], r"log_prob_use_dynamic_bsz=False must equal"),
        (["actor_rollout_ref.rollout.name=???"], r"left unset .*actor_rollout_ref.rollout.name"),
        (
            ["actor_rollout_ref.actor.loss_agg_mode=token-median"],
            r"(?s)validate_config.*Invalid loss_agg_mode: token-median",
        ),
    ],
)
def test_rejects(compose, overrides, match):
    from gtpo.verl_plugin.dry_run import run_dry

    cfg = compose("model=qwen2.5_32b", *overrides)
    with pytest.raises(ValueError, match=match):
        run_dry(cfg)


def test_config_left_untouched(compose):
    from omegaconf import OmegaConf

    from gtpo.verl_plugin.dry_run import run_dry

    cfg = compose("model=qwen2.5_7b")
    before = OmegaConf.to_yaml(cfg)
    run_dry(cfg)
    assert OmegaConf.to_yaml(cfg) == before
