"""Dry run: resolve, validate and print a launch configuration without starting Ray or touching a GPU.

``DRY_RUN=1 scripts/run_<method>_qwen2.5_<size>.sh`` makes the recipe's entry point call :func:`run_dry` right after
Hydra composition. It catches, on a laptop, the mistakes that otherwise surface minutes into a multi-node job:

1. unresolvable interpolations and mandatory ``???`` values left unset;
2. names missing from verl's registries (advantage estimator, policy loss, v1 trainer mode): the symptom of a plugin
   that was not imported (``VERL_USE_EXTERNAL_MODULES``);
3. batch arithmetic verl checks late, or only inside the workers (``verl/workers/engine_workers.py``,
   ``verl/utils/seqlen_balancing.py``): the train batch splits into whole PPO mini-batches, every mini-batch
   splits evenly over the data-parallel ranks (world size / Ulysses SP size), micro-batches divide the per-rank
   mini-batch, dynamic-batch token budgets hold one full prompt + response, the vLLM replicas (TP x DP x PP) tile
   the GPUs, and grouped estimators get at least two responses per prompt;
4. a soft overlong punishment whose buffer is not shorter than the response (it would penalise every response;
   ``gtpo.verl_plugin.validation.check_overlong_shaping``, also run at the recipe's startup);
5. verl's own ``verl.utils.config.validate_config``, called with ``use_reference_policy`` / ``use_critic`` computed
   as ``verl.trainer.main_ppo`` does;
6. under ``separate_async``, the standalone rollout pool's replicas tile its GPUs.

Then it prints the resolved configuration and a one-screen summary: the batch plan, the nodes the run needs
(``trainer.nnodes`` + the standalone rollout pool's), the run length, the vocabulary-sized memory terms of the
training and old-log-prob micro-batches (:mod:`gtpo.verl_plugin.memory_estimate`), whether this machine imports
the checkpoint engine's transport (the real run and the preflight refuse it if not; the dry run only reports it,
since a laptop is not the cluster's image) and the startup notes. Every failure is a ``ValueError`` naming the keys
and values at fault.

    python -m gtpo.verl_plugin.dry_run method=gtpo model=qwen2.5_7b      # same checks through Hydra's compose API

The module imports verl lazily, so ``import gtpo.verl_plugin.dry_run`` stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["BEGIN_MARK", "END_MARK", "GROUP_ESTIMATORS", "batch_plan", "compose_config", "main", "run_dry"]

# Estimators that normalise within a prompt's group of responses: with rollout.n == 1 every advantage is zero.
GROUP_ESTIMATORS = frozenset(
    {"grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gtpo", "grpo_s", "gtpo_traj"}
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# Lines around the printed YAML, so tools can cut the resolved config out of the log.
BEGIN_MARK = "----- BEGIN RESOLVED CONFIG -----"
END_MARK = "----- END RESOLVED CONFIG -----"


def _positive_int(cfg: DictConfig, key: str) -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: must be a positive integer")
    return value


def _resolved_copy(config: DictConfig) -> DictConfig:
    """A resolved deep copy (the caller's config is left untouched); unresolvable values raise ValueError."""
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    try:
        OmegaConf.resolve(cfg)
    except Exception as err:  # omegaconf raises several interpolation error types
        raise ValueError(f"configuration does not resolve: {err}") from None
    missing = sorted(key for key in OmegaConf.missing_keys(cfg) if not _unused(cfg, key))
    if missing:
        raise ValueError(f"mandatory value(s) left unset ('???'): {', '.join(missing)}")
    OmegaConf.set_struct(cfg, True)
    return cfg


def _unused(cfg: DictConfig, key: str) -> bool:
    """True for keys inside a section this run switches off (verl never reads their ``???`` placeholders)."""
    switched_off = {
        "reward.reward_model.": not OmegaConf.select(cfg, "reward.reward_model.enable", default=False),
        "distillation.": not OmegaConf.select(cfg, "distillation.enabled", default=False),
    }
    return any(key.startswith(prefix) and off for prefix, off in switched_off.items())


def _sp_size(node: DictConfig) -> int:
    """Ulysses size of an actor/ref node: the legacy top-level key wins when > 1, as FSDPActorConfig does."""
    legacy = node.get("ulysses_sequence_parallel_size", 1) or 1
    engine = (node.get("fsdp_config") or {}).get("ulysses_sequence_parallel_size", 1) or 1
    return legacy if legacy > 1 else engine


def batch_plan(cfg: DictConfig, use_reference_policy: bool = False) -> dict[str, Any]:
    """Check the batch arithmetic of a resolved config and return the numbers behind it.

    Args:
        cfg: resolved configuration (``actor_rollout_ref``, ``data``, ``trainer`` blocks of verl's ppo_trainer).
        use_reference_policy: whether the reference model runs (its token budget is then checked too).

    Returns:
        dict with ``n_gpus``, ``sp``, ``dp``, ``rollout_replicas``, ``max_seq_len``, ``sequences_per_step``,
        ``mini_batches_per_step``, ``sequences_per_rank_per_mini_batch``.

    Raises:
        ValueError: naming the keys whose values do not divide, do not fit, or are out of range.
    """
    arr = cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    nnodes = _positive_int(cfg, "trainer.nnodes")
    per_node = _positive_int(cfg, "trainer.n_gpus_per_node")
    n_gpus = nnodes * per_node
    train_bsz = _positive_int(cfg, "data.train_batch_size")
    n = _positive_int(cfg, "actor_rollout_ref.rollout.n")
    mini = _positive_int(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size")

    estimator = str(cfg.algorithm.adv_estimator)
    if estimator in GROUP_ESTIMATORS and n < 2:
        raise ValueError(
            f"actor_rollout_ref.rollout.n={n}: algorithm.adv_estimator={estimator} normalises within a group of "
            "responses per prompt and needs n >= 2"
        )

    sp = _sp_size(actor)
    if n_gpus % sp:
        raise ValueError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} does not divide the world size "
            f"trainer.nnodes * trainer.n_gpus_per_node = {nnodes} * {per_node} = {n_gpus}"
        )
    dp = n_gpus // sp
    fsdp_size = (actor.get("fsdp_config") or {}).get("fsdp_size", -1)
    if fsdp_size is not None and fsdp_size > 0 and n_gpus % fsdp_size:
        raise ValueError(f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} does not divide {n_gpus} GPUs")

    if mini > train_bsz or train_bsz % mini:
        raise ValueError(
            f"data.train_batch_size={train_bsz} must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{mini} (whole PPO mini-batches per step)"
        )
    mini_seqs = mini * n
    if mini_seqs % dp:
        raise ValueError(
            f"ppo_mini_batch_size * rollout.n = {mini} * {n} = {mini_seqs} sequences do not split evenly over "
            f"{dp} data-parallel ranks (world {n_gpus} / ulysses_sequence_parallel_size {sp})"
        )
    per_rank = mini_seqs // dp

    prompt = max(_positive_int(cfg, "data.max_prompt_length"), rollout.get("prompt_length") or 0)
    response = max(_positive_int(cfg, "data.max_response_length"), rollout.get("response_length") or 0)
    max_seq = prompt + response

    dynamic = bool(actor.use_dynamic_bsz)
    if bool(rollout.log_prob_use_dynamic_bsz) != dynamic:
        raise ValueError(
            f"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz={rollout.log_prob_use_dynamic_bsz} must equal "
            f"actor_rollout_ref.actor.use_dynamic_bsz={actor.use_dynamic_bsz} (the actor worker asserts it)"
        )
    if dynamic:
        budgets = [
            ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, sp),
            ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu, sp),
        ]
        if use_reference_policy and ref.get("log_prob_use_dynamic_bsz", dynamic):
            budgets.append(
                (
                    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                    ref.log_prob_max_token_len_per_gpu,
                    _sp_size(ref),
                )
            )
        for key, budget, group in budgets:
            # verl packs micro-batches of up to budget * sp tokens per SP group; one sequence must fit.
            if budget is None or budget * group < max_seq:
                raise ValueError(
                    f"{key}={budget} * ulysses_sequence_parallel_size {group} < max_prompt_length + "
                    f"max_response_length = {prompt} + {response} = {max_seq}: one full sequence must fit"
                )
    else:
        micro = actor.get("ppo_micro_batch_size_per_gpu")
        if micro is None or micro < 1 or per_rank % micro:
            raise ValueError(
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} must be set and divide the per-rank "
                f"mini-batch of {per_rank} sequences (use_dynamic_bsz=False)"
            )
        checks = [("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", rollout)]
        if use_reference_policy:
            checks.append(("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", ref))
        for key, node in checks:
            value = node.get("log_prob_micro_batch_size_per_gpu")
            if value is None or value < 1:
                raise ValueError(f"{key}={value}: must be a positive integer when use_dynamic_bsz=False")

    tp = _positive_int(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size")
    rdp = _positive_int(cfg, "actor_rollout_ref.rollout.data_parallel_size")
    rpp = _positive_int(cfg, "actor_rollout_ref.rollout.pipeline_model_parallel_size")
    replica = tp * rdp * rpp
    if n_gpus % replica or (replica > per_node and replica % per_node) or (replica < per_node and per_node % replica):
        raise ValueError(
            f"rollout replica size tensor_model_parallel_size * data_parallel_size * pipeline_model_parallel_size = "
            f"{tp} * {rdp} * {rpp} = {replica} must tile trainer.n_gpus_per_node={per_node} on {nnodes} node(s)"
        )
    util = rollout.gpu_memory_utilization
    if not 0.0 < util <= 1.0:
        raise ValueError(f"actor_rollout_ref.rollout.gpu_memory_utilization={util}: must be in (0, 1]")
    max_model_len = rollout.get("max_model_len")
    if max_model_len is not None and max_model_len < max_seq:
        raise ValueError(f"actor_rollout_ref.rollout.max_model_len={max_model_len} < prompt + response = {max_seq}")
    batched = rollout.get("max_num_batched_tokens")
    if not rollout.get("enable_chunked_prefill", True) and batched is not None and batched < max_seq:
        raise ValueError(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={batched} < prompt + response = {max_seq} while "
            "enable_chunked_prefill=False: vLLM cannot schedule a full-length prompt"
        )

    pool = rollout_pool(cfg)
    if pool is not None and pool[1] > 0:  # a pool of 0 GPUs is refused by check_trainer_mode, naming the key
        pool_nodes, pool_per_node = pool
        if (replica > pool_per_node and replica % pool_per_node) or (
            replica < pool_per_node and pool_per_node % replica
        ):
            raise ValueError(
                f"rollout replica size {replica} (tensor x data x pipeline parallel) must tile the standalone pool's "
                f"actor_rollout_ref.rollout.n_gpus_per_node={pool_per_node} on {pool_nodes} node(s)"
            )

    return {
        "n_gpus": n_gpus,
        "sp": sp,
        "dp": dp,
        "rollout_replicas": n_gpus // replica,
        "max_seq_len": max_seq,
        "sequences_per_step": train_bsz * n,
        "mini_batches_per_step": train_bsz // mini,
        "sequences_per_rank_per_mini_batch": per_rank,
        "dynamic_bsz": dynamic,
    }


def rollout_pool(cfg: DictConfig) -> tuple[int, int] | None:
    """``(nodes, GPUs per node)`` of the standalone rollout pool under separate_async, else None."""
    from gtpo.verl_plugin.async_checks import verl_mode

    if verl_mode(str(cfg.trainer.v1.trainer_mode)) != "separate_async":
        return None
    rollout = cfg.actor_rollout_ref.rollout
    return int(rollout.get("nnodes") or 0), int(rollout.get("n_gpus_per_node") or 0)


def _check_registries(cfg: DictConfig) -> None:
    """Names the config refers to must be registered in this process (plugins load on ``import verl``)."""
    from verl.trainer.ppo import core_algos

    estimator = str(cfg.algorithm.adv_estimator)
    hint = "is the plugin imported? set VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register"
    if estimator not in core_algos.ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"algorithm.adv_estimator={estimator}: not registered ({hint}); known: "
            f"{sorted(core_algos.ADV_ESTIMATOR_REGISTRY)}"
        )
    loss_mode = str(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)
    if loss_mode not in core_algos.POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}: not registered ({hint}); known: "
            f"{sorted(core_algos.POLICY_LOSS_REGISTRY)}"
        )
    if cfg.trainer.get("use_v1", True):
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        mode = str(cfg.trainer.v1.trainer_mode)
        if mode not in TRAINER_REGISTRY:
            raise ValueError(
                f"trainer.v1.trainer_mode={mode}: not registered ({hint}); known: {sorted(TRAINER_REGISTRY)}"
            )


def _verl_validate(cfg: DictConfig) -> tuple[bool, bool, str]:
    """verl's validate_config with the arguments main_ppo computes; returns (use_ref, use_critic, its output)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    use_ref = bool(need_reference_policy(cfg))
    use_critic = bool(need_critic(cfg))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            validate_config(config=cfg, use_reference_policy=use_ref, use_critic=use_critic)
    except (AssertionError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"verl.utils.config.validate_config rejected the configuration: {err}") from None
    except Exception as err:  # hydra InstantiationException wraps dataclass errors (unknown keys, bad values)
        if isinstance(err, ValueError):
            raise ValueError(f"verl.utils.config.validate_config: {err}") from None
        raise ValueError(f"verl.utils.config.validate_config: {type(err).__name__}: {err}") from None
    return use_ref, use_critic, out.getvalue()


def _checkpoint_engine_line(cfg: DictConfig) -> str:
    """Which transport the checkpoint engine imports and whether it imports on this machine."""
    from gtpo.verl_plugin.async_checks import ENGINE_MODULES, check_checkpoint_engine

    backend = cfg.actor_rollout_ref.rollout.checkpoint_engine.backend
    modules = ENGINE_MODULES.get(str(backend), ())
    if not modules:
        return f"checkpoint engine: {backend}"
    try:
        check_checkpoint_engine(cfg)
        here = "imports here"
    except ValueError:
        here = "does NOT import here: the real run and the preflight refuse to start without it"
    return f"checkpoint engine: {backend}, needs {', '.join(modules)}: {here}"


def run_dry(config: DictConfig) -> None:
    """Resolve, validate and print ``config``; never starts Ray, never touches an accelerator.

    Args:
        config: the composed Hydra config (unresolved is fine); it is not modified.

    Raises:
        ValueError: for the first problem found, naming the offending keys and values.
    """
    cfg = _resolved_copy(config)
    _check_registries(cfg)
    from verl.trainer.ppo.utils import need_reference_policy

    from gtpo.verl_plugin.async_checks import check_trainer_mode, startup_notes
    from gtpo.verl_plugin.memory_estimate import memory_lines
    from gtpo.verl_plugin.validation import check_overlong_shaping

    plan = batch_plan(cfg, use_reference_policy=bool(need_reference_policy(cfg)))
    check_overlong_shaping(cfg)
    check_trainer_mode(cfg)
    use_ref, use_critic, verl_out = _verl_validate(cfg)

    actor = cfg.actor_rollout_ref.actor
    print(BEGIN_MARK)
    print(OmegaConf.to_yaml(cfg, sort_keys=False).rstrip())
    print(END_MARK)
    print(verl_out.strip())
    print(
        "[dry run] method: "
        f"adv_estimator={cfg.algorithm.adv_estimator} loss_mode={actor.policy_loss.loss_mode} "
        f"loss_agg_mode={actor.loss_agg_mode} clip=({actor.clip_ratio_low}, {actor.clip_ratio_high}) "
        f"use_kl_loss={actor.use_kl_loss} use_kl_in_reward={cfg.algorithm.use_kl_in_reward} "
        f"reference_policy={use_ref} critic={use_critic} trainer_mode={cfg.trainer.v1.trainer_mode}"
    )
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    pool = rollout_pool(cfg)
    if pool is None:
        print(
            "[dry run] resources: "
            f"{cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} GPU(s) = {plan['n_gpus']}; "
            f"ulysses sp={plan['sp']} -> dp={plan['dp']}; vLLM replicas={plan['rollout_replicas']} (tp={tp})"
        )
    else:
        hybrid = bool(cfg.actor_rollout_ref.get("hybrid_engine", True))
        replica = plan["n_gpus"] // plan["rollout_replicas"]
        print(
            "[dry run] resources: "
            f"trainer {cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} GPU(s) = {plan['n_gpus']} "
            f"(ulysses sp={plan['sp']} -> dp={plan['dp']}; vLLM replicas there: "
            f"{plan['rollout_replicas'] if hybrid else 'none, hybrid_engine=false'}) + standalone rollout pool "
            f"{pool[0]} node(s) x {pool[1]} GPU(s) (vLLM replicas={pool[0] * pool[1] // replica}, tp={tp}): the "
            f"cluster needs {cfg.trainer.nnodes + pool[0]} GPU nodes"
        )
    print(
        "[dry run] batch: "
        f"{cfg.data.train_batch_size} prompts x n={cfg.actor_rollout_ref.rollout.n} = "
        f"{plan['sequences_per_step']} sequences/step in {plan['mini_batches_per_step']} mini-batch(es) of "
        f"{plan['sequences_per_rank_per_mini_batch']} sequences per dp rank; max sequence {plan['max_seq_len']} "
        f"tokens; dynamic_bsz={plan['dynamic_bsz']}"
    )
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    print(
        f"[dry run] validation: {cfg.data.val_files} n={val.n} temperature={val.temperature} top_p={val.top_p} "
        f"do_sample={val.do_sample}; test_freq={cfg.trainer.test_freq} val_before_train={cfg.trainer.val_before_train} "
        f"val_only={cfg.trainer.val_only}"
    )
    steps, epochs, bsz = cfg.trainer.total_training_steps, cfg.trainer.total_epochs, int(cfg.data.train_batch_size)
    if steps is not None:
        per_epoch = -(-int(steps) // max(int(epochs), 1))
        print(
            f"[dry run] run length: trainer.total_training_steps={steps}; verl stops earlier if "
            f"trainer.total_epochs={epochs} epochs end first, i.e. with fewer than {per_epoch} x {bsz} = "
            f"{per_epoch * bsz:,} training prompts (the preflight counts them)"
        )
    else:
        print(
            f"[dry run] run length: trainer.total_epochs={epochs} x (training prompts // {bsz}) steps "
            "(trainer.total_training_steps unset)"
        )
    for line in memory_lines(cfg):
        print(f"[dry run] {line}")
    print(f"[dry run] {_checkpoint_engine_line(cfg)}")
    for note in startup_notes(cfg):
        print(f"[dry run] note: {note}")
    buffer = OmegaConf.select(cfg, "reward.reward_kwargs.overlong_buffer_cfg", default=None)
    if buffer is not None and buffer.get("enable", False):
        max_len = cfg.reward.reward_kwargs.max_resp_len
        print(
            f"[dry run] overlong punishment: buffer {buffer.len} of {max_len} tokens (penalty from token "
            f"{max_len - buffer.len}, -{buffer.penalty_factor} at {max_len})"
        )
    print("[dry run] OK: configuration resolved and validated; Ray was not started.")


def compose_config(overrides: Sequence[str], config_dir: str | Path | None = None, config_name: str = "gtpo_trainer"):
    """Compose the recipe config with Hydra's compose API (the search path ``file://configs`` is relative to CWD)."""
    from hydra import compose, initialize_config_dir

    config_dir = Path(config_dir) if config_dir else REPO_ROOT / "recipe" / "gtpo" / "config"
    with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m gtpo.verl_plugin.dry_run [--config-dir D] [--config-name N] override ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-dir", default=None, help="default: recipe/gtpo/config of this repository")
    parser.add_argument("--config-name", default="gtpo_trainer")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method=gtpo model=qwen2.5_7b")
    args = parser.parse_args(argv)
    import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES and verl.plugins entry points)

    try:
        run_dry(compose_config(args.overrides, args.config_dir, args.config_name))
    except ValueError as err:
        print(f"[dry run] FAILED: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
