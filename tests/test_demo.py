"""The CPU demo (gtpo.cpu.demo): its reward, its offline assets, its trainer overrides, and that verl's real trainer
learns the task on CPU.

    .venv/bin/python -m pytest -q tests/test_demo.py -m "not e2e"     # unit tests, seconds
    .venv/bin/python -m pytest -q tests/test_demo.py -m e2e           # the demo learns (~4 min on 2 cores)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gtpo.cpu import demo
from tests.support.e2e import run_recipe, tail

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> demo.DemoAssets:
    return demo.build_demo_assets(tmp_path_factory.mktemp("demo_cache"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets.tokenizer_dir)


# ----------------------------------------------------------------------------------------------------------------
# reward


@pytest.mark.parametrize(
    ("response", "target", "expected"),
    [
        ("3", "3", 1.0),
        ("3 4 5", "3", 1.0),
        (" \n 3 \n", "3", 1.0),
        ("7", " 7 ", 1.0),
        ("4 3", "3", 0.0),
        ("33", "3", 0.0),
        ("three", "3", 0.0),
        ("", "3", 0.0),
        (" \n ", "3", 0.0),
        ("say 3", "3", 0.0),
    ],
)
def test_score_is_first_word_equals_target(response, target, expected):
    assert demo.score_response(response, target) == expected


def test_compute_score_takes_verl_keyword_arguments():
    # verl's naive reward manager calls it with these keywords (and may add more).
    kwargs = dict(data_source=demo.DATA_SOURCE, ground_truth="5", extra_info={"index": 0}, num_turns=1)
    assert demo.compute_score(solution_str="5 five", **kwargs) == 1.0
    assert demo.compute_score(solution_str="five 5", **kwargs) == 0.0
    assert demo.compute_score(solution_str=None, **kwargs) == 0.0


@pytest.mark.parametrize(
    "response, target, expected",
    [
        ("the 3", "3", 1.0),
        ("3 3", "3", 1.0),
        ("say 3 4", "3", 1.0),
        ("3", "3", 0.0),
        ("3 4", "3", 0.0),
        ("the three", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_second_word_task_scores_the_second_word(response, target, expected):
    assert demo.score_response(response, target, word_index=1) == expected
    source = demo.task_data_source("second_word")
    assert demo.compute_score(data_source=source, solution_str=response, ground_truth=target) == expected


def test_compute_score_picks_the_rule_by_data_source_and_names_a_foreign_one():
    assert demo.task_data_source("say_digit") == demo.DATA_SOURCE == "cpu_demo/say_digit"
    assert demo.compute_score(data_source=None, solution_str="5", ground_truth="5") == 1.0  # the demo's own task
    assert demo.compute_score(data_source="cpu_demo/second_word", solution_str="5", ground_truth="5") == 0.0
    for source in ("openai/gsm8k", "cpu_demo/third_word"):
        with pytest.raises(ValueError, match=f"data_source='{source}'.*cpu_demo/second_word"):
            demo.compute_score(data_source=source, solution_str="5", ground_truth="5")
    with pytest.raises(ValueError, match="task='third_word': unknown; known: say_digit, second_word"):
        demo.task_data_source("third_word")


def test_reward_is_binary_zero_one_for_gtpo():
    # GTPO splits correct / incorrect at reward > 0 (reward_threshold 0) with negative base -1: a 0/1 reward fits,
    # and a correct reward must be > 0 (gtpo.algorithms.gtpo_token.check_inputs).
    from gtpo.algorithms.gtpo_token import GTPOParams

    params = GTPOParams()
    assert params.reward_threshold == 0.0 and params.negative_base == "minus_one"
    assert demo.score_response("1", "1") > params.reward_threshold >= demo.score_response("2", "1")


# ----------------------------------------------------------------------------------------------------------------
# assets


def test_tokenizer_vocabulary(tokenizer):
    assert len(tokenizer) == 43
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    vocab = tokenizer.get_vocab()
    for word in ("say", *demo.DIGITS, *demo.NUMBER_WORDS, "\n"):
        assert word in vocab, word
    assert len(set(vocab.values())) == len(vocab) == 43


def test_newline_is_exactly_one_token(tokenizer):
    # verl 0.9.1's Qwen continuous-token builder rejects a tokenizer where "\n" is not one token (CPU_DEMO trap 2).
    ids = tokenizer.encode("\n", add_special_tokens=False)
    assert ids == [tokenizer.convert_tokens_to_ids("\n")]
    assert tokenizer.encode("<|im_end|>\n", add_special_tokens=False) == [tokenizer.eos_token_id, ids[0]]


@pytest.mark.parametrize("d", range(10))
def test_prompt_ids_are_exactly_say_and_digit(tokenizer, d):
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"say {d}"}], add_generation_prompt=True, tokenize=True
    )
    ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    assert list(ids) == [tokenizer.convert_tokens_to_ids("say"), tokenizer.convert_tokens_to_ids(str(d))]


def test_decoded_target_token_scores_one(tokenizer):
    # What the reward manager sees for a perfect response: the digit, then eos (skipped on decode).
    for d in demo.DIGITS:
        ids = [tokenizer.convert_tokens_to_ids(d), tokenizer.eos_token_id]
        assert demo.score_response(tokenizer.decode(ids, skip_special_tokens=True), d) == 1.0
    # a leading newline is whitespace, not a word
    newline_first = [tokenizer.convert_tokens_to_ids("\n"), tokenizer.convert_tokens_to_ids("4")]
    assert demo.score_response(tokenizer.decode(newline_first, skip_special_tokens=True), "4") == 1.0
    assert demo.score_response(tokenizer.decode([tokenizer.convert_tokens_to_ids("four")]), "4") == 0.0


def test_tokenizer_lives_in_its_own_folder(assets):
    # transformers 5 ignores a custom tokenizer saved next to a Qwen2 config.json (CPU_DEMO trap 1).
    model_dir, tok_dir = Path(assets.model_dir), Path(assets.tokenizer_dir)
    assert model_dir != tok_dir
    assert (tok_dir / "tokenizer.json").is_file() and not (tok_dir / "config.json").exists()
    assert not (model_dir / "tokenizer.json").exists()


def test_model_matches_tokenizer(assets, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets.model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.vocab_size == len(tokenizer) == 43
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 2, 1)
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.eos_token_id == tokenizer.eos_token_id and cfg.pad_token_id == tokenizer.pad_token_id
    assert 70_000 < sum(p.numel() for p in model.parameters()) < 85_000
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_seed_changes_the_model_and_rebuild_is_cached(tmp_path):
    import torch
    from safetensors.torch import load_file

    a0 = demo.build_demo_assets(tmp_path, seed=0)
    a1 = demo.build_demo_assets(tmp_path, seed=1)
    assert demo.build_demo_assets(tmp_path, seed=0) == a0
    w0 = load_file(str(Path(a0.model_dir) / "model.safetensors"))
    w1 = load_file(str(Path(a1.model_dir) / "model.safetensors"))
    key = "model.embed_tokens.weight"
    assert not torch.equal(w0[key], w1[key])
    with pytest.raises(ValueError, match="seed=-1"):
        demo.build_demo_assets(tmp_path, seed=-1)


def test_parquet_rows(assets):
    import pandas as pd

    train = pd.read_parquet(assets.train_parquet)
    val = pd.read_parquet(assets.val_parquet)
    assert len(train) == 1000 and len(val) == 10
    for df in (train, val):
        prompts = [list(p)[0]["content"] for p in df["prompt"]]
        truths = [rm["ground_truth"] for rm in df["reward_model"]]
        assert all(p == f"say {t}" for p, t in zip(prompts, truths))
        assert set(df["data_source"]) == {demo.DATA_SOURCE}
        assert all(len(list(p)) == 1 and list(p)[0]["role"] == "user" for p in df["prompt"])
    assert train["reward_model"].map(lambda rm: rm["ground_truth"]).value_counts().to_dict() == {
        d: 100 for d in demo.DIGITS
    }


def test_second_word_assets_share_the_model_and_prompts_and_differ_in_data_source(assets, tmp_path):
    import pandas as pd

    other = demo.build_demo_assets(tmp_path, seed=0, task="second_word")
    assert demo.recipe_key(0, "second_word") != demo.recipe_key(0) and other.model_dir != assets.model_dir
    weights = [Path(a.model_dir, "model.safetensors").read_bytes() for a in (assets, other)]
    assert weights[0] == weights[1]  # the model depends on the seed only
    mine, theirs = pd.read_parquet(assets.train_parquet), pd.read_parquet(other.train_parquet)
    assert set(theirs["data_source"]) == {"cpu_demo/second_word"}
    assert mine.drop(columns="data_source").to_json() == theirs.drop(columns="data_source").to_json()
    with pytest.raises(ValueError, match="task='first_word'"):
        demo.build_demo_assets(tmp_path, seed=0, task="first_word")


# ----------------------------------------------------------------------------------------------------------------
# trainer overrides and results


def test_overrides_compose_with_the_recipe(assets):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    overrides = [
        "backend=cpu_tiny",
        *demo.method_overrides("gtpo"),
        *demo.demo_overrides(assets, 7, 3, "/tmp/rollouts", method="gtpo"),
    ]
    old = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "recipe" / "gtpo" / "config"), version_base=None):
            cfg = compose(config_name="gtpo_trainer", overrides=overrides)
    finally:
        os.chdir(old)
    validate_recipe_config(cfg)
    assert cfg.algorithm.adv_estimator == "gtpo"
    # no normalisation override: the demo runs the paper's Eq. 6 (zero_fill, batch scope) and GROP of the preset
    assert cfg.algorithm.gtpo.norm_mode == "zero_fill" and cfg.algorithm.gtpo.norm_scope == "batch"
    assert cfg.algorithm.gtpo.weight_scope == "batch" and cfg.algorithm.grop.enable is True
    # no estimator override: the demo runs the recipe's GTPO defaults
    assert not any(o.lstrip("+").startswith("algorithm.gtpo") for o in overrides)
    assert cfg.actor_rollout_ref.model.tokenizer_path == assets.tokenizer_dir
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.rollout.enable_sleep_mode is False
    assert cfg.actor_rollout_ref.rollout.n == 16 and cfg.data.train_batch_size == 8
    assert cfg.data.max_response_length == cfg.actor_rollout_ref.rollout.response_length == 4
    assert cfg.trainer.total_training_steps == 7 and cfg.data.seed == 3
    assert cfg.reward.custom_reward_function.path == "pkg://gtpo.cpu.demo"
    assert OmegaConf.select(cfg, "trainer.rollout_data_dir") == "/tmp/rollouts"
    # 8 prompts x 16 samples in mini-batches of 2 prompts: 4 PPO updates per step.
    assert cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4


def test_grpo_gets_no_gtpo_setting(assets):
    ov = demo.demo_overrides(assets, 5, 0, method="grpo")
    assert not any("algorithm.gtpo" in o for o in ov)
    assert demo.method_overrides("grpo") in (["method=grpo"], ["algorithm.adv_estimator=grpo"])


PRESETS = ("grpo", "dapo", "dapo_forking", "gtpo", "grpo_s", "gtpo_traj")


def compose_demo(assets, method: str, extra: tuple[str, ...] = ()):
    from hydra import compose, initialize_config_dir

    import gtpo.verl_plugin.register  # noqa: F401

    overrides = ["backend=cpu_tiny", *demo.method_overrides(method), *demo.demo_overrides(assets, 3, 0), *extra]
    old = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        with initialize_config_dir(config_dir=str(REPO_ROOT / "recipe" / "gtpo" / "config"), version_base=None):
            return compose(config_name="gtpo_trainer", overrides=overrides)
    finally:
        os.chdir(old)


@pytest.mark.parametrize("method", PRESETS)
def test_every_preset_composes_with_the_demo_pins(assets, method):
    from omegaconf import OmegaConf

    from gtpo.launch.checks import validate_recipe_config

    preset = OmegaConf.load(REPO_ROOT / "configs" / "method" / f"{method}.yaml")
    cfg = compose_demo(assets, method)
    validate_recipe_config(cfg)  # DAPO's 1,024-token overlong buffer in a 4-token response would raise here
    # the preset's method survives: estimator, policy loss, reward manager, forking
    assert cfg.algorithm.adv_estimator == preset.algorithm.adv_estimator
    loss_mode = OmegaConf.select(preset, "actor_rollout_ref.actor.policy_loss.loss_mode", default="vanilla")
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert cfg.reward.reward_manager.name == OmegaConf.select(preset, "reward.reward_manager.name", default="naive")
    assert cfg.algorithm.forking.enable == OmegaConf.select(preset, "algorithm.forking.enable", default=False)
    # the same pins for every method: the task, the budget, no dynamic sampling, no overlong punishment
    assert cfg.data.max_response_length == cfg.actor_rollout_ref.rollout.response_length == 4
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n) == (8, 16)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 2 and cfg.actor_rollout_ref.actor.optim.lr == 1e-3
    assert cfg.algorithm.filter_groups.enable is False
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.enable is False
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == cfg.actor_rollout_ref.actor.clip_ratio_low == 0.2
    assert cfg.actor_rollout_ref.actor.loss_agg_mode == "token-mean"


def test_dapo_overlong_buffer_without_the_pin_is_rejected_at_config_time(assets):
    from gtpo.launch.checks import validate_recipe_config

    cfg = compose_demo(assets, "dapo", ("++reward.reward_kwargs.overlong_buffer_cfg.enable=True",))
    with pytest.raises(ValueError, match="overlong_buffer_cfg.len=1024 >= reward.reward_kwargs.max_resp_len=4"):
        validate_recipe_config(cfg)


def test_bad_arguments_raise(assets):
    with pytest.raises(ValueError, match="steps=0"):
        demo.demo_overrides(assets, 0, 0)
    with pytest.raises(ValueError, match="method="):
        demo.method_overrides("grpo data.x=1")


def test_load_rewards_and_summary(tmp_path):
    path = tmp_path / "m.jsonl"
    values = [0.0] * 10 + [0.5] * 5 + [1.0] * 10
    lines = [json.dumps({"step": i + 1, "data": {demo.REWARD_KEY: v, "x": 1}}) for i, v in enumerate(values)]
    lines.insert(3, json.dumps({"step": 0, "data": {"val-core/x": 0.1}}))
    path.write_text("\n".join(lines) + '\n{"step": 99, "da')
    rewards = demo.load_rewards(path)
    assert [s for s, _ in rewards] == list(range(1, 26))
    summary = demo.summarize(rewards, window=10, target=0.8)
    assert summary["first_mean"] == 0.0 and summary["last_mean"] == 1.0
    # trailing 10-step means: step 23 -> (2 x 0.5 + 8 x 1) / 10 = 0.9, step 22 -> (3 x 0.5 + 7) / 10 = 0.85,
    # step 21 -> 0.8, step 20 -> (5 x 0.5 + 5) / 10 = 0.75
    assert summary["step_reaching_target"] == 21
    assert demo.summarize([]) == {"steps": 0}


def test_latest_token_dump(tmp_path):
    for name in ("tokens_2.jsonl", "tokens_10.jsonl", "tokens_x.jsonl", "11.jsonl"):
        (tmp_path / name).write_text("")
    assert demo.latest_token_dump(tmp_path) == tmp_path / "tokens_10.jsonl"


# ----------------------------------------------------------------------------------------------------------------
# end to end: the demo learns

E2E_STEPS = 50
E2E_WINDOW = 5


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_learns(ray_cluster, assets, tmp_path):
    """GTPO (the demo's default) through verl's trainer: the mean reward of the last steps clearly beats the first."""
    overrides = [
        *demo.method_overrides("gtpo"),
        *demo.demo_overrides(assets, E2E_STEPS, 0, tmp_path / "rollouts", method="gtpo"),
    ]
    result = run_recipe(ray_cluster, tmp_path, overrides, timeout=900, name="demo")
    assert result.returncode == 0, tail(result.log)
    rewards = [v for _, v in demo.load_rewards(tmp_path / "demo.metrics.jsonl")]
    assert len(rewards) == E2E_STEPS, tail(result.log)
    first = sum(rewards[:E2E_WINDOW]) / E2E_WINDOW
    last = sum(rewards[-E2E_WINDOW:]) / E2E_WINDOW
    assert first < 0.3, rewards
    assert last > first + 0.3, rewards
    # the GTPO estimator really ran (its diagnostics are logged)
    assert any(k.startswith("gtpo/") for k in result.last()), sorted(result.last())


def test_make_plots_draws_curves_and_the_heatmap_of_the_mixed_step(tmp_path, assets):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "\n".join(
            json.dumps({"step": s, "data": {demo.REWARD_KEY: v, "actor/entropy": 3.0}})
            for s, v in [(1, 0.1), (2, 0.45), (3, 0.9)]
        )
        + "\n"
    )
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    rec = {
        "step": 0,
        "uid": "u",
        "prompt": "say 3",
        "response_tokens": ["3", "\n"],
        "advantages": [1.0, 0.5],
        "entropy": [2.0, 1.0],
        "score": 1.0,
    }
    for step in (1, 2, 3):
        (rollouts / f"tokens_{step}.jsonl").write_text(json.dumps({**rec, "step": step}) + "\n")
    written = demo.make_plots(tmp_path, "gtpo", metrics, rollouts, assets.tokenizer_dir, [])
    assert written["heatmap_step"] == 2  # reward closest to 0.5
    assert Path(written["curves"]).is_file()
    assert (tmp_path / "heatmap" / "tokens_2.advantage.png").is_file()
    # Without token dumps: verl's text dump of that step, coloured by score.
    for p in rollouts.glob("tokens_*.jsonl"):
        p.unlink()
    (rollouts / "2.jsonl").write_text(
        json.dumps({"input": "say 3", "output": "3", "score": 1.0, "step": 2, "uid": "u_0_0"}) + "\n"
    )
    written = demo.make_plots(tmp_path / "text", "gtpo", metrics, rollouts, assets.tokenizer_dir, [])
    assert written["heatmap_step"] == 2 and (tmp_path / "text" / "heatmap" / "2.score.png").is_file()


def test_an_unknown_method_is_one_line_naming_presets_and_estimators(capsys):
    assert demo.main(["--method", "nope", "--dry-run", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "error: method='nope': neither a method preset (dapo, dapo_forking, grpo, grpo_s, gtpo, gtpo_traj)" in err
    assert "registered advantage estimator (gae," in err and "Traceback" not in err
    # a registered estimator without a preset still runs as one
    assert demo.method_overrides("rloo") == ["algorithm.adv_estimator=rloo"]


@pytest.mark.slow  # one verl import per case in the trainer's entry point (~15 s on two cores)
@pytest.mark.parametrize("override", [None, "trainer.total_training_step=5"])
def test_the_dry_run_validates_the_trainer_config_with_the_overrides(assets, capsys, tmp_path, override):
    """``--dry-run -- <override>`` used to print the trainer command and exit 0 whatever the override; now the entry
    point checks it as a launcher's DRY_RUN=1 does (the full config composed and validated, no Ray), a misspelt key
    is one line and exit 2, and nothing is written (no output folder, no Hydra folder)."""
    out = tmp_path / "out"
    cache = Path(assets.model_dir).parents[1]  # the module's assets, not rebuilt
    argv = ["--dry-run", "--steps", "3", "--out", str(out), "--cache-dir", str(cache)]
    code = demo.main(argv + (["--", override] if override else []))
    captured = capsys.readouterr()
    assert not out.exists()  # nor its hydra/ folder, which a real run's hydra.run.dir names
    if override is None:
        assert code == 0, captured.err[-2000:]
        assert captured.out.splitlines()[-1].startswith("[dry run] OK: configuration resolved and validated")
        assert "[dry run] batch: 8 prompts x n=16 = 128 sequences/step in 4 mini-batch(es)" in captured.out
        return
    assert code == 2
    assert captured.err.splitlines()[0] == (
        "gtpo: invalid configuration: trainer.total_training_step: no key 'total_training_step' in trainer; "
        "closest: trainer.total_training_steps"
    )
    assert "Traceback" not in captured.err and "[dry run] OK" not in captured.out


def test_a_local_run_starts_its_own_ray_even_when_a_gone_cluster_is_recorded(monkeypatch, tmp_path):
    """A node killed without ``ray stop`` leaves its address in ``<tmp>/ray/ray_current_cluster``; ``ray.init()``
    without an address would join it (and refuse the trainer's num_cpus). The trainer's environment says "local"."""
    from ray._private.services import canonicalize_bootstrap_address

    from gtpo.cpu.demo_trainer import trainer_env

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("192.0.2.2:42289")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert canonicalize_bootstrap_address(None) is not None  # what verl's ray.init() would join
    monkeypatch.setenv("RAY_ADDRESS", trainer_env()["RAY_ADDRESS"])
    assert canonicalize_bootstrap_address(None) is None  # a new local instance
    # joining a cluster, the trainer carries that cluster's token variables from this environment, unchanged
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/private/token")
    joined = trainer_env("10.0.0.1:6379")
    assert joined["RAY_ADDRESS"] == "10.0.0.1:6379" and joined["RAY_AUTH_TOKEN_PATH"] == "/private/token"
    # a local cluster gets a fresh token of its own in the private folder given
    (tmp_path / "auth").mkdir(mode=0o700)
    local = trainer_env(None, tmp_path / "auth")
    assert local["RAY_AUTH_MODE"] == "token" and local["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "auth" / "token")
    assert len((tmp_path / "auth" / "token").read_text()) == 64
