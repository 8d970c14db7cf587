"""The CPU demo's trainer command: its Hydra overrides (shared settings, per-method settings) and environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from gtpo.cpu.demo_task import DemoAssets

REPO_ROOT = Path(__file__).resolve().parents[2]

# Rows of the demo's batch (8 prompts x 16 samples) and of one PPO mini-batch (2 prompts x 16 samples).
BATCH_ROWS = 8 * 16
MINI_BATCH_ROWS = 2 * 16
# Length limits of the demo: prompts ("say <d>", 2 tokens) and responses (1 to 4 tokens).
MAX_PROMPT_TOKENS = 8
MAX_RESPONSE_TOKENS = 4
# Demo sequences: a 2-token prompt and a 1- to 4-token response; the prompt limit bounds them.
MIN_SEQUENCE_TOKENS = 2 + 1
LONGEST_DEMO_SEQUENCE = 2 + MAX_RESPONSE_TOKENS
MAX_SEQUENCE_TOKENS = MAX_PROMPT_TOKENS + MAX_RESPONSE_TOKENS
# Token budgets of the backend's dynamic micro-batches. Each must hold verl's 128-token synthetic padding row (added
# when a failed rollout session leaves the batch short of a multiple of the ranks). At one rank a mini-batch share
# (32 rows, 96-192 tokens) then trains in one or two micro-batches, and the old-log-prob pass (128 rows, 384-768
# tokens) runs in three to six forwards, each packing rows of different lengths.
TRAIN_TOKEN_BUDGET = 128
LOG_PROB_TOKEN_BUDGET = 128

# Trainer settings of the demo, appended after backend=cpu_tiny and the method preset, the same for every method so
# that all of them run the same task with the same budget. They pin what a preset sets that does not fit a 4-token
# task or would make runs incomparable: the scale preset's batch, lengths, group size and learning rate; DAPO dynamic
# sampling (it would also bias the logged training reward towards mixed groups); DAPO's soft overlong punishment
# (a 1,024-token buffer cannot fit in a 4-token response: the recipe rejects it, verl asserts on it); clip-higher;
# KL loss (no reference model); loss aggregation; and the mini-batch (gtpo_traj's one update per step).
DEMO_SETTINGS: tuple[str, ...] = (
    "data.train_batch_size=8",
    f"data.max_prompt_length={MAX_PROMPT_TOKENS}",
    f"data.max_response_length={MAX_RESPONSE_TOKENS}",
    "data.filter_overlong_prompts=False",
    "data.truncation=error",
    "data.dataloader_num_workers=0",
    "actor_rollout_ref.rollout.n=16",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.top_p=1.0",
    "actor_rollout_ref.rollout.top_k=-1",
    f"actor_rollout_ref.rollout.response_length={MAX_RESPONSE_TOKENS}",
    f"actor_rollout_ref.rollout.prompt_length={MAX_PROMPT_TOKENS}",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TRAIN_TOKEN_BUDGET}",
    f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={LOG_PROB_TOKEN_BUDGET}",
    f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={LOG_PROB_TOKEN_BUDGET}",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.2",
    "algorithm.use_kl_in_reward=False",
    "algorithm.filter_groups.enable=False",
    "++reward.reward_kwargs.overlong_buffer_cfg.enable=False",
    "reward.custom_reward_function.path=pkg://gtpo.cpu.demo",
    "reward.custom_reward_function.name=compute_score",
    "trainer.total_epochs=1000",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.val_before_train=False",
    "trainer.logger=[console,file]",
    "trainer.project_name=gtpo_cpu_demo",
)

# Per-method demo settings, appended after DEMO_SETTINGS (none: every method runs its preset and the recipe's defaults).
METHOD_SETTINGS: dict[str, tuple[str, ...]] = {}


# ----------------------------------------------------------------------------------------------------------------
# trainer command


def method_overrides(method: str) -> list[str]:
    """``method=<m>`` when ``configs/method/<m>.yaml`` exists, else ``algorithm.adv_estimator=<m>``."""
    if not method or not all(c.isalnum() or c in "_-." for c in method):
        raise ValueError(f"method={method!r}: expected a preset or estimator name such as gtpo or grpo")
    if (REPO_ROOT / "configs" / "method" / f"{method}.yaml").is_file():
        return [f"method={method}"]
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    import gtpo.verl_plugin.register  # noqa: F401  (the recipe's estimators)

    if method not in ADV_ESTIMATOR_REGISTRY:
        presets = sorted(p.stem for p in (REPO_ROOT / "configs" / "method").glob("*.yaml"))
        raise ValueError(
            f"method={method!r}: neither a method preset ({', '.join(presets)}) nor a registered advantage estimator "
            f"({', '.join(sorted(ADV_ESTIMATOR_REGISTRY))})"
        )
    return [f"algorithm.adv_estimator={method}"]


def world_overrides(nnodes: int = 1, gpus_per_node: int = 1) -> list[str]:
    """The demo's world size, refused when its mini-batch does not split evenly over the ranks (each rank then packs
    its share into token-budget micro-batches)."""
    for name, value in (("nnodes", nnodes), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    world = nnodes * gpus_per_node
    if MINI_BATCH_ROWS % world:
        allowed = [w for w in range(1, MINI_BATCH_ROWS + 1) if MINI_BATCH_ROWS % w == 0]
        raise ValueError(
            f"world size {nnodes} x {gpus_per_node} = {world}: the demo's mini-batch of {MINI_BATCH_ROWS} responses "
            f"splits evenly only over {allowed} ranks"
        )
    return [
        f"trainer.nnodes={nnodes}",
        f"trainer.n_gpus_per_node={gpus_per_node}",
    ]


def demo_overrides(
    assets: DemoAssets,
    steps: int,
    seed: int,
    rollout_dir: str | os.PathLike | None = None,
    experiment: str = "demo",
    method: str | None = None,
    nnodes: int = 1,
    gpus_per_node: int = 1,
) -> list[str]:
    """Hydra overrides of the demo run (without ``backend=`` / ``method=``); ``method`` adds its METHOD_SETTINGS;
    ``nnodes`` x ``gpus_per_node`` FSDP ranks and vLLM replicas (:func:`world_overrides`)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be a positive int")
    world = world_overrides(nnodes, gpus_per_node)
    out = [
        f"data.train_files={assets.train_parquet}",
        f"data.val_files={assets.val_parquet}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer_dir}",
        *DEMO_SETTINGS,
        *world,
        *METHOD_SETTINGS.get(method or "", ()),
        f"trainer.total_training_steps={steps}",
        f"trainer.experiment_name={experiment}",
    ]
    if rollout_dir is not None:
        out.append(f"trainer.rollout_data_dir={rollout_dir}")
    return out


def lora_overrides(rank: int) -> list[str]:
    """LoRA adapters of ``rank`` on every linear layer (alpha = rank, as ``configs/adapter/lora.yaml``), synced to
    vLLM's LoRA (``punica_cpu``) after each step."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank={rank!r}: must be a positive int")
    return [
        f"actor_rollout_ref.model.lora_rank={rank}",
        f"actor_rollout_ref.model.lora_alpha={rank}",
        "actor_rollout_ref.model.target_modules=all-linear",
    ]


def trainer_command(method: str, overrides: list[str], metrics_path: str | os.PathLike, extra: list[str]) -> list[str]:
    """Full command line of the trainer subprocess (run it from the repository root)."""
    return [
        sys.executable,
        "-m",
        "recipe.gtpo.main_gtpo",
        "backend=cpu_tiny",
        *method_overrides(method),
        *overrides,
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics_path}",
        *extra,
    ]


def trainer_env(ray_address: str | None = None, token_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """This process's environment plus the CPU backend's variables, and the Ray cluster the trainer joins:
    ``ray_address``, or a new local one (``RAY_ADDRESS=local``; without it verl's ``ray.init()`` would join the
    cluster ``/tmp/ray/ray_current_cluster`` names, even one that has gone).

    Joining ``ray_address``, the trainer carries the cluster's token variables from this environment (what
    ``python -m gtpo.cpu.cluster start`` printed); the trainer refuses at once without them. A new local cluster gets
    a fresh token in ``token_dir`` (a private folder, :func:`gtpo.private_files.write_ray_token`) rather than Ray's
    shared ``~/.ray/auth_token``.
    """
    from gtpo.cpu import env as cpu_env
    from gtpo.private_files import ray_token_env, write_ray_token

    env = dict(os.environ)
    env.update(cpu_env())
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("WANDB_MODE", "disabled")
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    else:
        env["RAY_ADDRESS"] = "local"
        if token_dir is not None:
            env.pop("RAY_AUTH_TOKEN", None)
            env.update(ray_token_env(write_ray_token(token_dir)))
    return env
