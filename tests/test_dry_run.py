"""gtpo/launch/dry_run.py: every batch-arithmetic and registry check fails with the offending key named.

    .venv/bin/pytest -q tests/test_dry_run.py

Composes the recipe config in-process (Hydra compose API, CWD = repository root) with the shipped presets and
breaks one value per case; the unbroken 7B and 32B configs must pass. Nothing here starts Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checkpoints import complete_checkpoint

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

    from gtpo.launch.batch_checks import batch_plan

    cfg = compose(f"model=qwen2.5_{size}", f"scale={scale}")
    OmegaConf.resolve(cfg)
    assert batch_plan(cfg) == {**expected, "dynamic_bsz": True, "rollout_pool": None}


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
        (
            ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2000"],
            r"ppo_max_token_len_per_gpu=2000: a micro-batch holds",
        ),
        (
            ["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=2000"],
            r"rollout.log_prob_max_token_len_per_gpu=2000",
        ),
        (["actor_rollout_ref.rollout.n=1"], r"rollout.n=1: algorithm.adv_estimator=gtpo"),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], r"replica size .* = 3 must tile"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=256"], r"ppo_mini_batch_size=256 > data.train_batch_size=128"),
        (["trainer.nnodes=3"], r"= 512 responses per mini-batch do not split evenly over .*: 24 data-parallel ranks"),
        (["data.max_response_length=200000"], r"less than one full sequence of .*= 202048 tokens"),
        (["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], r"gpu_memory_utilization=1.5"),
        (["algorithm.adv_estimator=no_such_estimator"], r"adv_estimator=no_such_estimator: not registered"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=no_such_loss"], r"loss_mode=no_such_loss: not registered"),
        (["trainer.v1.trainer_mode=no_such_mode"], r"trainer_mode=no_such_mode: not registered"),
        (
            [
                "actor_rollout_ref.actor.use_dynamic_bsz=false",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
            ],
            r"Please set at least one of 'actor.ppo_micro_batch_size' or 'actor.ppo_micro_batch_size_per_gpu'",
        ),
        (["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false"], r"log_prob_use_dynamic_bsz=False must equal"),
        (["actor_rollout_ref.rollout.name=???"], r"left unset .*actor_rollout_ref.rollout.name"),
        (
            ["actor_rollout_ref.actor.loss_agg_mode=token-median"],
            r"(?s)validate_config.*Invalid loss_agg_mode: token-median",
        ),
        # the CPU backend's attention on a GPU run: every worker would fail building the model, GPUs allocated
        (
            ["+actor_rollout_ref.model.override_config.attn_implementation=gtpo_cpu_sdpa"],
            r"attn_implementation=gtpo_cpu_sdpa with trainer\.device=cuda: the CPU test backend's attention",
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


MICRO_BATCH_SCOPE = ["algorithm.forking.scope=micro_batch", "actor_rollout_ref.actor.calculate_entropy=true"]


@pytest.mark.parametrize(
    "size,extra,lines",
    [
        # the preset's scope=batch selects on the old policy's entropy: the training pass computes none, one logits
        # copy (its gradient written in place), as for the other methods
        ("7b", [], ["training micro-batch: logits 24,576 x 152,064 x 2 B x 1 = 7.0 GiB (gradient written in place)"]),
        ("32b", [], ["training micro-batch: logits 22,528 x 152,064 x 2 B x 1 = 6.4 GiB (gradient written in place)"]),
        # scope=micro_batch: the forking loss detaches the training policy's entropy, so only calculate_entropy's extra
        # logits copy remains (no in-place cross-entropy backward); the entropy chunks are transient
        (
            "7b",
            MICRO_BATCH_SCOPE,
            [
                "training micro-batch: logits 24,576 x 152,064 x 2 B x 2 = 13.9 GiB",
                "entropy chunk 2,048 x 152,064 x 4 B x 3 = 3.5 GiB (transient, forward only: the forking loss detaches",
            ],
        ),
        ("32b", MICRO_BATCH_SCOPE, ["training micro-batch: logits 22,528 x 152,064 x 2 B x 2 = 12.8 GiB"]),
        # with an entropy bonus the gradient flows: the review's 27.8 / 25.5 GiB recompute and 3 logits copies
        (
            "7b",
            ["actor_rollout_ref.actor.entropy_coeff=0.001"],
            [
                "logits 24,576 x 152,064 x 2 B x 3 = 20.9 GiB",
                "entropy kept for its backward 24,576 x 152,064 x 4 B x 2 = 27.8 GiB",
            ],
        ),
        # (its training pass, about 83 GiB, does not fit the preset's 80 GB cards: the dry run is asked about 141 GB)
        (
            "32b",
            ["actor_rollout_ref.actor.entropy_coeff=0.001", "algorithm.hardware.gpu_memory_gib=[141]"],
            ["22,528 x 152,064 x 4 B x 2 = 25.5 GiB"],
        ),
    ],
)
def test_dry_run_prints_the_forking_pass_memory_terms(compose, capsys, size, extra, lines):
    from gtpo.launch.dry_run import run_dry

    run_dry(compose("method=dapo_forking", f"model=qwen2.5_{size}", *extra))
    out = capsys.readouterr().out
    assert f"vocabulary 152,064: Qwen2.5-{size.upper()}'s, by the folder's name" in out
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
    assert "+ standalone rollout pool 2 node(s) x 8 GPU(s) (vLLM replicas=4, tp=4): 6 GPU nodes, or fewer where" in out
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

    from tests.support.launch import dry_run_env, script_path

    cmd = ["bash", str(script_path("gtpo", "7b")), "algorithm.gtpo.alpha2=abc"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dry_run_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gtpo: invalid configuration: algorithm.gtpo.alpha2='abc': must be a finite real number" in proc.stderr
    assert "Traceback" not in proc.stderr
    env = {**dry_run_env(tmp_path), "GTPO_TRACEBACK": "1"}
    traced = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert traced.returncode != 0 and "Traceback" in traced.stderr and "alpha2='abc'" in traced.stderr


def _composition_error(*overrides: str) -> Exception:
    from gtpo.launch.dry_run import compose_config

    try:
        compose_config(["method=gtpo", "model=qwen2.5_7b", *overrides])
    except Exception as err:  # Hydra's composition errors, whatever their class
        return err
    raise AssertionError(f"{overrides} composed")


@pytest.mark.parametrize(
    "override,line",
    [
        # a misspelt key: the closest keys at its level, not Hydra's advice to add it with `+`
        (
            "trainer.total_training_step=5",
            "trainer.total_training_step: no key 'total_training_step' in trainer; closest: "
            "trainer.total_training_steps",
        ),
        ("trainer.v1x.trainer_mode=x", "trainer.v1x.trainer_mode: no key 'v1x' in trainer; closest: trainer.v1"),
        ("algorithm.gtpo.alpah2=0.2", "algorithm.gtpo.alpah2: no key 'alpah2' in algorithm.gtpo; closest: "),
        # nothing close: every key of that level
        ("trainer.zzzzzz=1", "trainer.zzzzzz: no key 'zzzzzz' in trainer; valid: trainer.balance_batch, "),
        ("sampling=papr", "sampling=papr: no preset 'papr' in group sampling; valid: dapo, paper, r1"),
        ("method=gtpoo", "method=gtpoo: no preset 'gtpoo' in group method; valid: dapo, dapo_forking, grpo, grpo_s, "),
        ("trainer.nnodes=[1", "trainer.nnodes=[1: not an override (no viable alternative at input '[1')"),
        ("+trainer.nnodes=2", "Could not append to config. An item is already at 'trainer.nnodes'."),
    ],
)
def test_composition_errors_are_one_line_naming_the_valid_names(compose, override, line):
    from gtpo.launch.dry_run import config_error_line

    message = config_error_line(_composition_error(override))
    assert message.startswith(line) and "\n" not in message, message
    assert "To append to your config use +" not in message


def test_other_errors_are_not_composition_errors():
    from gtpo.launch.dry_run import config_error_line

    assert config_error_line(ValueError("x")) is None and config_error_line(KeyError("trainer")) is None


@pytest.fixture
def entry_point(monkeypatch, capsys):
    """``python -m recipe.gtpo.main_gtpo <overrides>`` in this process, up to Hydra's composition."""
    from hydra.core.global_hydra import GlobalHydra

    from recipe.gtpo import main_gtpo

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("GTPO_TRACEBACK", raising=False)

    def run(*overrides: str) -> tuple[int, str]:
        monkeypatch.setattr("sys.argv", ["main_gtpo.py", *overrides])
        try:
            with pytest.raises(SystemExit) as exited:
                main_gtpo.main()
        finally:
            GlobalHydra.instance().clear()
        return exited.value.code, capsys.readouterr().err

    return run


@pytest.mark.parametrize("full_error", ["1", None])
def test_the_entry_point_prints_a_misspelt_key_in_one_line(entry_point, monkeypatch, full_error):
    """With or without HYDRA_FULL_ERROR (the launcher exports 1): one line and CONFIG_ERROR_EXIT, before any
    check or Ray; GTPO_TRACEBACK=1 gives Hydra's exception itself."""
    from hydra.errors import ConfigCompositionException

    from recipe.gtpo.main_gtpo import CONFIG_ERROR_EXIT

    if full_error:
        monkeypatch.setenv("HYDRA_FULL_ERROR", full_error)
    else:
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, err = entry_point("method=gtpo", "trainer.total_training_step=5")
    assert code == CONFIG_ERROR_EXIT == 2
    assert err == (
        "gtpo: invalid configuration: trainer.total_training_step: no key 'total_training_step' in trainer; "
        "closest: trainer.total_training_steps\n"
    )
    code, err = entry_point("method=gtpoo")
    assert code == 2 and err.startswith("gtpo: invalid configuration: method=gtpoo: no preset 'gtpoo' in group method")
    assert err.count("\n") == 1
    monkeypatch.setenv("GTPO_TRACEBACK", "1")
    monkeypatch.setattr("sys.argv", ["main_gtpo.py", "trainer.total_training_step=5"])
    from recipe.gtpo import main_gtpo

    with pytest.raises(ConfigCompositionException, match="total_training_step"):
        main_gtpo.main()


def test_the_dry_run_entry_point_keeps_hydras_folder_out_of_the_working_directory(monkeypatch):
    """scratch_run_dir: hydra.run.dir=<tmp> before the first override (Hydra's parser takes no override after a flag;
    a hydra.run.dir of the caller's comes later and wins), the folder gone afterwards, argv restored."""
    from gtpo.launch.dry_run import scratch_run_dir

    argv = ["main_gtpo.py", "--config-name", "gtpo_trainer", "method=gtpo", "hydra.run.dir=/mine"]
    with scratch_run_dir(argv) as tmp:
        assert Path(tmp).is_dir()
        assert argv == ["main_gtpo.py", "--config-name", "gtpo_trainer", f"hydra.run.dir={tmp}", "method=gtpo",
                        "hydra.run.dir=/mine"]  # fmt: skip
        (Path(tmp) / ".hydra").mkdir()
    assert not Path(tmp).exists() and argv[3] == "method=gtpo" and len(argv) == 5
    bare = ["main_gtpo.py"]
    with scratch_run_dir(bare) as tmp:
        assert bare == ["main_gtpo.py", f"hydra.run.dir={tmp}"]


def test_a_validation_only_run_needs_its_checkpoint_here_and_complete(compose, capsys, tmp_path):
    """scripts/eval_checkpoint.sh's dry run (trainer.val_only=true, resume_mode=resume_path) evaluates that very
    checkpoint: missing or incomplete, it fails naming the folder and what it lacks; a training resume only says so."""
    from gtpo.launch.dry_run import run_dry

    folder = tmp_path / "global_step_30"
    evaluate = ("model=qwen2.5_7b", "trainer.val_only=true", "trainer.resume_mode=resume_path")
    with pytest.raises(ValueError, match=rf"trainer.resume_from_path={folder}: no such folder here"):
        run_dry(compose(*evaluate, f"trainer.resume_from_path={folder}"))
    complete_checkpoint(folder, 30)
    run_dry(compose(*evaluate, f"trainer.resume_from_path={folder}"))
    assert f"[dry run] resume: trainer.resume_from_path={folder}, a complete checkpoint" in capsys.readouterr().out
    (folder / "gtpo_state.json").unlink()
    (folder / "actor" / "optim_world_size_8_rank_7.pt").unlink()
    with pytest.raises(ValueError, match=r"incomplete checkpoint: actor/ lacks optim_world_size_8_rank_7.pt, no gtpo"):
        run_dry(compose(*evaluate, f"trainer.resume_from_path={folder}"))
    # training from it: reported, not refused (the trainer loads a named folder as asked, with a warning)
    run_dry(compose("model=qwen2.5_7b", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder}"))
    assert "incomplete checkpoint: actor/ lacks optim_world_size_8_rank_7.pt" in capsys.readouterr().out


def test_the_preflight_and_the_dry_run_cli_print_a_misspelt_key_in_one_line(compose, capsys, monkeypatch):
    """Both compose the config themselves (Hydra's compose API): one line naming the closest key, exit 2."""
    from gtpo.launch import dry_run, preflight

    monkeypatch.delenv("GTPO_TRACEBACK", raising=False)
    assert preflight.main(["method=gtpo", "trainer.total_training_step=5"]) == 2
    out = capsys.readouterr().out
    assert out == (
        "[preflight] FAIL config: trainer.total_training_step: no key 'total_training_step' in trainer; closest: "
        "trainer.total_training_steps\n"
    )
    assert dry_run.main(["method=gtpoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[dry run] FAILED: method=gtpoo: no preset 'gtpoo' in group method; valid: dapo,")
    assert err.count("\n") == 1


def test_the_forking_preset_computes_the_training_entropy_only_where_its_scope_reads_it(compose):
    """scope=batch reads the old policy's entropy: calculate_entropy off (one logits copy less per micro-batch);
    scope=micro_batch reads the training policy's and is refused without it."""
    from gtpo.launch.checks import check_config

    preset = compose("method=dapo_forking", "model=qwen2.5_7b")
    assert preset.algorithm.forking.scope == "batch" and preset.actor_rollout_ref.actor.calculate_entropy is False
    check_config(preset)
    with pytest.raises(ValueError, match=r"scope=micro_batch with actor_rollout_ref\.actor\.calculate_entropy=false"):
        check_config(compose("method=dapo_forking", "model=qwen2.5_7b", "algorithm.forking.scope=micro_batch"))
    check_config(compose("method=dapo_forking", "model=qwen2.5_7b", *MICRO_BATCH_SCOPE))
