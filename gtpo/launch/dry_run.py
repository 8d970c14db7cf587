"""Dry run: resolve, validate and print a launch configuration without starting Ray or touching a GPU.

``DRY_RUN=1 scripts/run_<method>_qwen2.5_<size>.sh`` makes the recipe's entry point call :func:`run_dry` right after
Hydra composition. It catches, on a laptop, the mistakes that otherwise surface minutes into a multi-node job:

1. unresolvable interpolations and mandatory ``???`` values left unset;
2. names missing from verl's registries (advantage estimator, policy loss, v1 trainer mode): the symptom of a plugin
   that was not imported (``VERL_USE_EXTERNAL_MODULES``);
3. batch arithmetic verl checks late, or only inside the workers (:mod:`gtpo.launch.batch_plan`): the train
   batch splits into whole PPO mini-batches, every mini-batch splits evenly over the data-parallel ranks, micro-batches
   divide the per-rank mini-batch, dynamic-batch token budgets hold one full prompt + response, the vLLM replicas
   tile the GPUs, and grouped estimators get at least two responses per prompt;
4. a soft overlong punishment whose buffer is not shorter than the response (it would penalise every response;
   ``gtpo.launch.validation.check_overlong_shaping``, also run at the recipe's startup);
5. verl's own ``verl.utils.config.validate_config``, called with ``use_reference_policy`` / ``use_critic`` computed
   as ``verl.trainer.main_ppo`` does;
6. under ``separate_async``, the standalone rollout pool's replicas tile its GPUs.

Then it prints the resolved configuration and a one-screen summary: the batch plan, the nodes the run needs
(``trainer.nnodes`` + the standalone rollout pool's), the run length, the vocabulary-sized memory terms of the
training and old-log-prob micro-batches (:mod:`gtpo.launch.memory_estimate`), whether this machine imports
the checkpoint engine's transport (the real run and the preflight refuse it if not; the dry run only reports it,
since a laptop is not the cluster's image) and the startup notes. Every failure is a ``ValueError`` naming the keys
and values at fault.

    python -m gtpo.launch.dry_run method=gtpo model=qwen2.5_7b      # same checks through Hydra's compose API

The module imports verl lazily, so ``import gtpo.launch.dry_run`` stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from gtpo.launch.batch_plan import batch_plan, rollout_pool

__all__ = [
    "BEGIN_MARK",
    "CONFIG_ERROR_EXIT",
    "END_MARK",
    "compose_config",
    "config_error_line",
    "main",
    "run_dry",
    "scratch_run_dir",
]

REPO_ROOT = Path(__file__).resolve().parents[2]

# Lines around the printed YAML, so tools can cut the resolved config out of the log.
BEGIN_MARK = "----- BEGIN RESOLVED CONFIG -----"
END_MARK = "----- END RESOLVED CONFIG -----"
# Exit status of a configuration refused before Ray starts, as recipe.gtpo.main_gtpo.CONFIG_ERROR_EXIT (that module
# imports Ray and verl; this one stays cheap).
CONFIG_ERROR_EXIT = 2


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
    from gtpo.launch.async_checks import ENGINE_MODULES, check_checkpoint_engine

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


def _resume_line(cfg: DictConfig, use_critic: bool) -> str | None:
    """What ``trainer.resume_mode=resume_path`` loads. A validation-only run (scripts/eval_checkpoint.sh) evaluates
    that checkpoint, so it must be here and complete as the resume defines it
    (:func:`gtpo.trainer.resume.checkpoints.incomplete_reasons`); a training resume is only reported (this machine
    may not see the cluster's folder, and the trainer loads an incomplete one as asked, with a warning)."""
    trainer = cfg.trainer
    if str(trainer.get("resume_mode")) != "resume_path" or not trainer.get("resume_from_path"):
        return None
    from gtpo.launch.async_checks import verl_mode
    from gtpo.trainer.resume.checkpoints import incomplete_reasons, layout_of

    folder = os.path.abspath(str(trainer.resume_from_path))
    step = re.fullmatch(r"global_step_(\d+)", os.path.basename(folder))
    if not os.path.isdir(folder):
        problem = "no such folder here"
    elif step is None:
        problem = "not a checkpoint folder global_step_<N>"
    else:
        async_mode = verl_mode(str(trainer.v1.trainer_mode)) != "sync"
        reasons = incomplete_reasons(folder, int(step.group(1)), layout_of(cfg, use_critic, async_mode))
        problem = f"incomplete checkpoint: {', '.join(reasons)}" if reasons else ""
    if not problem:
        return f"resume: trainer.resume_from_path={folder}, a complete checkpoint"
    if trainer.get("val_only", False):
        raise ValueError(f"trainer.resume_from_path={folder}: {problem} (trainer.val_only=true evaluates it)")
    return f"resume: trainer.resume_from_path={folder}: {problem}; the trainer checks it again before loading"


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

    from gtpo.launch.async_checks import check_trainer_mode, startup_notes
    from gtpo.launch.memory_estimate import memory_lines
    from gtpo.launch.state_memory import state_lines
    from gtpo.launch.validation import check_overlong_shaping

    plan = batch_plan(cfg, use_reference_policy=bool(need_reference_policy(cfg)))
    check_overlong_shaping(cfg)
    check_trainer_mode(cfg)
    use_ref, use_critic, verl_out = _verl_validate(cfg)
    resume = _resume_line(cfg, use_critic)

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
            f"{pool[0]} node(s) x {pool[1]} GPU(s) (vLLM replicas={pool[0] * pool[1] // replica}, tp={tp}): "
            f"{cfg.trainer.nnodes + pool[0]} GPU nodes, or fewer where a node holds a trainer and a pool share"
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
    if resume:
        print(f"[dry run] {resume}")
    for line in memory_lines(cfg) + state_lines(cfg):
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


def config_error_line(err: BaseException) -> str | None:
    """One line for an error of Hydra's composition, naming the override and the valid names; None for any other.

    A misspelt key (``trainer.total_training_step=5``) gets the closest keys at its level rather than Hydra's advice
    to add it with ``+`` (verl would never read it); an unknown preset (``method=gtpoo``) gets the group's presets.
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf import DictConfig
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options is not None:
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        return f"{group}={name}: no preset {name!r} in group {group}; valid: {', '.join(err.options)}"
    if isinstance(err, OverrideParseException):
        return f"{err.override}: not an override ({str(err).splitlines()[0]}); the syntax is key=value"
    if not isinstance(err, ConfigCompositionException):
        return None
    cause = err.__cause__
    override = re.match(r"Could not override '([^']+)'", str(err))
    if override and isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        level, _, key = str(cause.full_key).rpartition(".")
        parent = cause.parent_node
        keys = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
        named = ", ".join(f"{level}.{k}" if level else k for k in close or sorted(keys))
        where = level or "the config"
        return f"{override.group(1)}: no key {key!r} in {where}; {'closest' if close else 'valid'}: {named}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if cause is not None:
        lines += [line.strip() for line in str(cause).splitlines()[:1] if line.strip()]
    return " ".join(lines) or type(err).__name__


@contextlib.contextmanager
def scratch_run_dir(argv: list[str]) -> Iterator[str]:
    """Hydra's run folder (``.hydra/`` and the job log; ``outputs/<date>/<time>/`` under the working directory, the
    checkout, by default) in a temporary folder removed on exit, for a run that must leave no file behind: a dry run.

    ``hydra.run.dir=<tmp>`` goes into ``argv`` (``sys.argv``) before the first override, so one given on the command
    line still wins (the last override of a key does) and Hydra's parser, which takes no override after a flag, still
    sees the overrides together.
    """
    with tempfile.TemporaryDirectory(prefix="gtpo-dry-run-") as tmp:
        arg = f"hydra.run.dir={tmp}"
        at = next((i for i, a in enumerate(argv) if i and "=" in a and not a.startswith("-")), len(argv))
        argv.insert(at, arg)
        try:
            yield tmp
        finally:
            argv.remove(arg)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m gtpo.launch.dry_run [--config-dir D] [--config-name N] override ...``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-dir", default=None, help="default: recipe/gtpo/config of this repository")
    parser.add_argument("--config-name", default="gtpo_trainer")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. method=gtpo model=qwen2.5_7b")
    args = parser.parse_args(argv)
    import verl  # noqa: F401  (loads VERL_USE_EXTERNAL_MODULES and verl.plugins entry points)

    try:
        config = compose_config(args.overrides, args.config_dir, args.config_name)
    except Exception as err:
        line = config_error_line(err)
        if line is None or os.environ.get("GTPO_TRACEBACK", "0") == "1":
            raise
        print(f"[dry run] FAILED: {line}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        run_dry(config)
    except ValueError as err:
        print(f"[dry run] FAILED: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
