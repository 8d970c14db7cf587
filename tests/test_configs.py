"""Every shipped Hydra config composes with verl 0.9.1's ppo_trainer and passes the recipe's startup validation.

.venv/bin/python -m pytest -q tests/test_configs.py
"""

from __future__ import annotations

import pytest

from gtpo.launch.runs import missing_piece
from gtpo.methods import METHODS
from tests.support.configs import CONFIG_DIR, REPO_ROOT, compose

PRESET_GROUPS = ("method", "model", "scale", "backend", "sampling")
# Every group the defaults list picks from configs/ (trainer=separate_async alone does not validate: it needs a pool).
ALL_GROUPS = (*PRESET_GROUPS, "trainer")


def _presets(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO_ROOT / "configs" / group).glob("*.yaml"))


MODELS = _presets("model")
# paper A's scale runs on every model preset; DAPO's on those it has a per-model piece for (the launcher refuses the
# others by name: tests/test_launch_scripts.py)
SCALED = [(scale, model) for scale in ("paper", "dapo") for model in MODELS if not missing_piece("scale", scale, model)]


def test_recipe_config_composes_with_defaults():
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config
    from gtpo.methods import knob

    cfg = compose([])
    assert cfg.algorithm.adv_estimator == "gtpo"
    assert cfg.trainer.v1.trainer_mode == "gtpo_sync"
    validate_recipe_config(cfg)
    knobs = {block: knob(cfg.algorithm, block) for block in ("gtpo", "grpo_s")}
    assert knobs["gtpo"].alpha1 == 1.0 and knobs["gtpo"].alpha2 == 0.1
    assert knobs["grpo_s"].beta1 == 1.0 and knobs["grpo_s"].beta2 == 0.1


def test_every_preset_group_is_populated():
    for group in PRESET_GROUPS:
        assert _presets(group), f"configs/{group}/ has no preset"
    assert _presets("method") == sorted(METHODS), "a preset per row of gtpo.methods.METHODS, and no other"
    assert {"qwen2.5_7b", "qwen2.5_32b"} <= set(MODELS)


@pytest.mark.parametrize("group", PRESET_GROUPS)
def test_each_preset_composes_and_validates(group):
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    for name in _presets(group):
        cfg = compose([f"{group}={name}"])
        validate_recipe_config(cfg)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model", MODELS)
def test_method_and_model_presets_compose_together(method, model):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    if method not in _presets("method") or model not in _presets("model"):
        pytest.fail(f"missing preset method={method} or model={model}")
    cfg = compose([f"method={method}", f"model={model}"])
    validate_recipe_config(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert not need_critic(cfg), "no method of this recipe trains a critic"


def test_bad_knob_fails_at_startup_with_the_key_named():
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    with pytest.raises(ValueError, match=r"algorithm\.gtpo\.alpha2"):
        validate_recipe_config(compose(["algorithm.gtpo.alpha2=-1.0"]))
    with pytest.raises(ValueError, match=r"algorithm\.gtpo\.norm_mode"):
        validate_recipe_config(compose(["algorithm.gtpo.norm_mode=sideways"]))
    with pytest.raises(ValueError, match=r"algorithm\.gtpo\.not_a_knob"):
        validate_recipe_config(compose(["+algorithm.gtpo.not_a_knob=1"]))
    with pytest.raises(ValueError, match=r"trainer\.v1\.trainer_mode"):
        validate_recipe_config(compose(["trainer.v1.trainer_mode=sync"]))
    with pytest.raises(ValueError, match=r"algorithm\.adv_estimator=nope: not registered"):
        validate_recipe_config(compose(["algorithm.adv_estimator=nope"]))
    with pytest.raises(ValueError, match=r"bypass_mode"):
        validate_recipe_config(
            compose(["algorithm.rollout_correction.bypass_mode=true", "algorithm.adv_estimator=grpo_s"])
        )


def test_grop_hard_group_punishment_ends_at_the_response_length():
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    on = ["method=gtpo", "algorithm.grop.hard_mode=dapo"]
    validate_recipe_config(compose(on))  # paper scale: 4096 = the default L_max
    validate_recipe_config(compose([*on, "scale=dapo", "algorithm.grop.dapo_max_length=20480"]))
    with pytest.raises(ValueError, match=r"algorithm\.grop\.dapo_max_length=4096 != data\.max_response_length=20480"):
        validate_recipe_config(compose([*on, "scale=dapo"]))
    with pytest.raises(ValueError, match=r"algorithm\.grop\.dapo_max_length=2048 != data\.max_response_length=4096"):
        validate_recipe_config(compose([*on, "algorithm.grop.dapo_max_length=2048"]))
    # Unused (hard_mode=none, the default): no constraint.
    validate_recipe_config(compose(["method=gtpo", "algorithm.grop.dapo_max_length=2048"]))


def test_knobs_override_without_plus():
    cfg = compose(["algorithm.gtpo.alpha2=0.2", "algorithm.grpo_s.beta2=0.3"])
    assert cfg.algorithm.gtpo.alpha2 == 0.2
    assert cfg.algorithm.grpo_s.beta2 == 0.3


@pytest.mark.parametrize("scale,model", SCALED)
@pytest.mark.parametrize("method", METHODS)
def test_scale_presets_compose_with_every_method_and_model(scale, method, model):
    """paper is the default scale; dapo is one group choice away, for every method and model."""
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    cfg = compose([f"method={method}", f"model={model}", f"scale={scale}"])
    validate_recipe_config(cfg)
    want = {"paper": (128, 4096), "dapo": (512, 20480)}[scale]
    assert (cfg.data.train_batch_size, cfg.data.max_response_length) == want
    assert cfg.actor_rollout_ref.rollout.n == 16 and cfg.data.max_prompt_length == 2048
    if scale == "paper":
        assert cfg == compose([f"method={method}", f"model={model}"]), "scale=paper is not the default"


def test_paper_validation_preset_with_the_three_benchmarks():
    """sampling=paper with AIME 2024, AIME 2025 and MATH 500 as the list of validation files."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    files = "[d/aime2024.parquet,d/aime2025.parquet,d/math500.parquet]"
    cfg = compose(["method=gtpo", "model=qwen2.5_7b", "sampling=paper", f"data.val_files={files}"])
    validate_recipe_config(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert list(cfg.data.val_files) == ["d/aime2024.parquet", "d/aime2025.parquet", "d/math500.parquet"]
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert (val.temperature, val.top_p, val.n, val.do_sample) == (1.0, 1.0, 32, True)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["reward.reward_kwargs.overlong_buffer_cfg.len=4096"],
            r"overlong_buffer_cfg\.len=4096 >= .*max_resp_len=4096",
        ),
        (["reward.reward_kwargs.overlong_buffer_cfg.len=0"], r"overlong_buffer_cfg\.len=0: must be a positive"),
        (["scale=dapo", "reward.reward_kwargs.max_resp_len=16384"], r"max_resp_len=16384 != data\.max_response_length"),
    ],
)
def test_startup_validation_rejects_the_overlong_trap(overrides, match):
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import validate_recipe_config

    validate_recipe_config(compose(["method=dapo"]))  # the preset itself passes
    with pytest.raises(ValueError, match=match):
        validate_recipe_config(compose(["method=dapo", *overrides]))


@pytest.mark.parametrize(
    "group,typo",
    [
        ("method", "gtpoo"),
        ("model", "qwen2.5-7b"),
        ("scale", "papr"),
        ("sampling", "Paper"),
        ("trainer", "separate-async"),
        ("backend", "cpu"),
    ],
)
def test_a_mistyped_preset_name_fails_naming_it_and_the_valid_ones(group, typo):
    """No preset group is `optional` in the defaults list: an unknown name cannot compose without its preset."""
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as err:
        compose([f"{group}={typo}"])
    message = str(err.value)
    assert f"Could not find '{group}/{typo}'" in message
    listed = message.split(f"Available options in '{group}':", 1)[1]
    for name in _presets(group):
        assert f"\t{name}\n" in listed, name


def test_the_six_preset_groups_are_required_entries_of_the_defaults_list():
    import yaml

    defaults = yaml.safe_load((CONFIG_DIR / "gtpo_trainer.yaml").read_text())["defaults"]
    entries = {key: value for item in defaults if isinstance(item, dict) for key, value in item.items()}
    for group in ALL_GROUPS:
        assert group in entries and f"optional {group}" not in entries, group
    assert entries["scale"] == "paper" and all(entries[g] is None for g in ALL_GROUPS if g != "scale")


@pytest.mark.parametrize(
    "override,expect",
    [
        # a misspelt key or group: Hydra's struct mode names it
        ("trainer.total_training_step=100", "Could not override 'trainer.total_training_step'"),
        ("methods=gtpo", "Could not override 'methods'"),
        # an empty preset name lists the valid ones
        ("method=", "Available options in 'method':\n\tdapo\n"),
        # two presets at once
        ("method=gtpo,dapo", "Ambiguous value for argument 'method=gtpo,dapo'"),
    ],
)
def test_other_command_line_mistakes_fail_at_composition(override, expect):
    from hydra.errors import HydraException

    with pytest.raises(HydraException) as err:
        compose([override])
    assert expect in str(err.value)


@pytest.mark.parametrize(
    "scale,steps,max_model_len",
    [("paper", 210, 6144), ("dapo", None, 22528), ("smoke", None, 2048)],
)
def test_scale_presets_set_the_run_length_and_vllm_context(scale, steps, max_model_len):
    """scale=paper stops at paper A's 210 steps (Sec. 3.3); vLLM's context is prompt + response at every scale."""
    from omegaconf import OmegaConf

    cfg = compose([f"scale={scale}", "method=gtpo"])
    OmegaConf.resolve(cfg)
    assert cfg.trainer.total_training_steps == steps
    assert cfg.actor_rollout_ref.rollout.max_model_len == max_model_len
    assert max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length


@pytest.mark.parametrize(
    "overrides,loggers",
    [
        (["model=qwen2.5_7b"], ["console", "wandb", "file"]),
        (["model=qwen2.5_32b"], ["console", "wandb", "file"]),
        (["model=qwen2.5_0.5b", "scale=smoke"], ["console", "file"]),  # the smoke launcher's: no tracker account
    ],
)
def test_cluster_presets_keep_the_metric_history_in_a_file(overrides, loggers):
    """verl's ``file`` logger in every cluster preset: the JSONL metric history exists without W&B (verl's own
    default is console + wandb)."""
    from verl.utils.tracking import Tracking

    cfg = compose(["method=gtpo", *overrides])
    assert list(cfg.trainer.logger) == loggers
    assert set(loggers) <= set(Tracking.supported_backend)
