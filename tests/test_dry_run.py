"""gtpo/launch/dry_run.py: every batch-arithmetic and registry check fails with the offending key named.

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
    from gtpo.launch.dry_run import compose_config

    monkeypatch.chdir(REPO)
    return lambda *overrides: compose_config(["method=gtpo", *overrides])


@pytest.mark.parametrize("size", ["7b", "32b"])
def test_presets_pass(compose, capsys, size):
    from gtpo.launch.dry_run import BEGIN_MARK, END_MARK, run_dry

    run_dry(compose(f"model=qwen2.5_{size}"))
    out = capsys.readouterr().out
    assert BEGIN_MARK in out and END_MARK in out and "[dry run] OK" in out


@pytest.mark.parametrize(
    "size,scale,expected",
    [
        # Paper A (default scale): 4 x 8 GPUs, no Ulysses -> dp 32; TP 4 -> 8 vLLM replicas; 128 x 16 sequences in
        # 4 mini-batches of 32 x 16 / 32 per rank; 2048 + 4096 tokens.
        ("32b", "paper", dict(n_gpus=32, sp=1, dp=32, rollout_replicas=8, max_seq_len=6144, sequences_per_step=2048,
                              mini_batches_per_step=4, sequences_per_rank_per_mini_batch=16)),
        ("7b", "paper", dict(n_gpus=8, sp=1, dp=8, rollout_replicas=8, max_seq_len=6144, sequences_per_step=2048,
                             mini_batches_per_step=4, sequences_per_rank_per_mini_batch=64)),
        # DAPO's scale: Ulysses 8 -> dp 4; 512 x 16 sequences in 16 mini-batches of 32 x 16 / 4; 2048 + 20480 tokens.
        ("32b", "dapo", dict(n_gpus=32, sp=8, dp=4, rollout_replicas=8, max_seq_len=22528, sequences_per_step=8192,
                             mini_batches_per_step=16, sequences_per_rank_per_mini_batch=128)),
        ("7b", "dapo", dict(n_gpus=8, sp=4, dp=2, rollout_replicas=4, max_seq_len=22528, sequences_per_step=8192,
                            mini_batches_per_step=16, sequences_per_rank_per_mini_batch=256)),
    ],
)  # fmt: skip
def test_batch_plan_numbers(compose, size, scale, expected):
    from omegaconf import OmegaConf

    from gtpo.launch.batch_plan import batch_plan

    cfg = compose(f"model=qwen2.5_{size}", f"scale={scale}")
    OmegaConf.resolve(cfg)
    assert batch_plan(cfg) == {**expected, "dynamic_bsz": True}


@pytest.mark.parametrize("method", ["dapo", "dapo_forking"])
@pytest.mark.parametrize("size", ["7b", "32b"])
@pytest.mark.parametrize("scale,response,buffer", [("paper", 4096, 1024), ("dapo", 20480, 4096)])
def test_overlong_buffer_follows_the_scale(monkeypatch, capsys, method, size, scale, response, buffer):
    """The presets' soft overlong window at each scale: 1024 of 4096 (paper A), DAPO's own 4096 of 20480."""
    import verl  # noqa: F401

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.dry_run import compose_config, run_dry

    monkeypatch.chdir(REPO)
    cfg = compose_config([f"method={method}", f"model=qwen2.5_{size}", f"scale={scale}"])
    run_dry(cfg)
    out = capsys.readouterr().out
    assert f"overlong punishment: buffer {buffer} of {response} tokens (penalty from token {response - buffer}" in out
    kwargs = cfg.reward.reward_kwargs
    assert kwargs.max_resp_len == cfg.data.max_response_length == response
    assert kwargs.overlong_buffer_cfg.enable and kwargs.overlong_buffer_cfg.len == buffer


@pytest.mark.parametrize(
    "overrides,match",
    [
        # DAPO's 4096 buffer at paper A's 4096-token responses: every response penalised from its first token.
        ([], r"reward\.reward_kwargs\.overlong_buffer_cfg\.len=4096 >= reward\.reward_kwargs\.max_resp_len=4096"),
        (
            ["data.max_response_length=2048"],
            r"overlong_buffer_cfg\.len=4096 >= reward\.reward_kwargs\.max_resp_len=2048",
        ),
        (["reward.reward_kwargs.max_resp_len=8192"], r"max_resp_len=8192 != data\.max_response_length=4096"),
    ],
)
def test_rejects_overlong_buffer_trap(monkeypatch, overrides, match):
    import verl  # noqa: F401

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.dry_run import compose_config, run_dry

    monkeypatch.chdir(REPO)
    cfg = compose_config(
        ["method=dapo", "model=qwen2.5_7b", "reward.reward_kwargs.overlong_buffer_cfg.len=4096", *overrides]
    )
    with pytest.raises(ValueError, match=match):
        run_dry(cfg)


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
        (["actor_rollout_ref.actor.ppo_mini_batch_size=30"], r"train_batch_size=128 must be a multiple of .*=30"),
        (["trainer.nnodes=3"], r"32 \* 16 = 512 sequences do not split evenly over 24 data-parallel ranks"),
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
    from gtpo.launch.dry_run import run_dry

    cfg = compose("model=qwen2.5_32b", *overrides)
    with pytest.raises(ValueError, match=match):
        run_dry(cfg)


def test_config_left_untouched(compose):
    from omegaconf import OmegaConf

    from gtpo.launch.dry_run import run_dry

    cfg = compose("model=qwen2.5_7b")
    before = OmegaConf.to_yaml(cfg)
    run_dry(cfg)
    assert OmegaConf.to_yaml(cfg) == before


@pytest.mark.parametrize(
    "size,extra,lines",
    [
        # the fix: the forking loss detaches the training policy's entropy, so only calculate_entropy's extra logits
        # copy remains (no in-place cross-entropy backward); the entropy chunks are transient
        (
            "7b",
            [],
            [
                "training micro-batch: logits 24,576 x 152,064 x 2 B x 2 = 13.9 GiB",
                "entropy chunk 2,048 x 152,064 x 4 B x 3 = 3.5 GiB (transient, forward only: the forking loss detaches",
            ],
        ),
        ("32b", [], ["training micro-batch: logits 22,528 x 152,064 x 2 B x 2 = 12.8 GiB"]),
        # with an entropy bonus the gradient flows: the review's 27.8 / 25.5 GiB recompute and 3 logits copies
        (
            "7b",
            ["actor_rollout_ref.actor.entropy_coeff=0.001"],
            [
                "logits 24,576 x 152,064 x 2 B x 3 = 20.9 GiB",
                "entropy kept for its backward 24,576 x 152,064 x 4 B x 2 = 27.8 GiB",
            ],
        ),
        ("32b", ["actor_rollout_ref.actor.entropy_coeff=0.001"], ["22,528 x 152,064 x 4 B x 2 = 25.5 GiB"]),
    ],
)
def test_dry_run_prints_the_forking_pass_memory_terms(compose, capsys, size, extra, lines):
    from gtpo.launch.dry_run import run_dry

    run_dry(compose("method=dapo_forking", f"model=qwen2.5_{size}", *extra))
    out = capsys.readouterr().out
    assert "vocabulary 152,064: Qwen2.5-7B / 32B's, assumed" in out
    for line in lines:
        assert line in out, line


def test_memory_terms_of_the_other_methods_and_a_readable_vocabulary(compose, capsys, tmp_path):
    from gtpo.launch.dry_run import run_dry

    model = tmp_path / "Qwen2.5-0.5B-Instruct"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 151936}')
    run_dry(compose("method=dapo", "model=qwen2.5_7b", f"actor_rollout_ref.model.path={model}"))
    out = capsys.readouterr().out
    assert f"vocabulary 151,936: vocab_size of {model / 'config.json'}" in out
    # no entropy in the training pass: flash-attn writes the logits' gradient in place
    assert "training micro-batch: logits 24,576 x 151,936 x 2 B x 1 = 7.0 GiB (gradient written in place)" in out
    assert "old-log-prob micro-batch: logits 49,152 x 151,936 x 2 B x 1 = 13.9 GiB (no backward)" in out


def test_separate_async_dry_run_states_the_nodes_the_engine_and_the_batch_note(compose, capsys):
    from gtpo.launch.dry_run import run_dry

    run_dry(compose("model=qwen2.5_32b", "trainer=separate_async", "actor_rollout_ref.rollout.nnodes=2"))
    out = capsys.readouterr().out
    assert (
        "+ standalone rollout pool 2 node(s) x 8 GPU(s) (vLLM replicas=4, tp=4): the cluster needs 6 GPU nodes" in out
    )
    assert "[dry run] checkpoint engine: nccl, needs cupy: does NOT import here" in out  # no cupy on this machine
    assert "[dry run] note: algorithm.gtpo.norm_scope=batch, algorithm.gtpo.weight_scope=batch" in out


def test_term_arithmetic():
    from gtpo.launch.memory_estimate import GIB, Term

    term = Term("logits", 24_576, 152_064, 2, 2, "why")
    assert term.gib == 24_576 * 152_064 * 2 * 2 / GIB == pytest.approx(13.92, abs=0.01)
    assert str(term) == "logits 24,576 x 152,064 x 2 B x 2 = 13.9 GiB (why)"


def test_a_bad_knob_on_a_launcher_is_one_line_and_exit_2(tmp_path):
    """``algorithm.gtpo.alpha2=abc`` on a launcher: the value and what is allowed, no Python traceback (unless
    ``GTPO_TRACEBACK=1``), before Ray starts."""
    import subprocess

    from tests.test_launch_scripts import dry_run_env, script_path

    cmd = ["bash", str(script_path("gtpo", "7b")), "algorithm.gtpo.alpha2=abc"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dry_run_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gtpo: invalid configuration: algorithm.gtpo.alpha2='abc': must be a finite real number" in proc.stderr
    assert "Traceback" not in proc.stderr
    env = {**dry_run_env(tmp_path), "GTPO_TRACEBACK": "1"}
    traced = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert traced.returncode != 0 and "Traceback" in traced.stderr and "alpha2='abc'" in traced.stderr
