"""Dry run: resolve, check and print a launch configuration without starting Ray or touching a GPU.

``DRY_RUN=1 bash scripts/run.sh METHOD MODEL`` (or a published ``scripts/run_<method>_<model>.sh``) makes the
recipe's entry point run every check before Ray (:func:`gtpo.launch.checks.check_config`: resolution, registries,
the recipe's rules, the batch arithmetic, verl's own ``validate_config``) and then :func:`run_dry`, which prints, in
this order: the verdict with the run's shape and method, the plan (resources, batch, validation, run length, the
checkpoint a resume would load, the vocabulary-sized memory terms of :mod:`gtpo.launch.memory_estimate` and
:mod:`gtpo.launch.state_memory`, each pass's GPU peak on the GPUs the run is sized for (:mod:`gtpo.launch.gpu_peak`),
the checkpoint engine's transport, startup notes), then the resolved configuration
between :data:`BEGIN_MARK` and :data:`END_MARK`. Every failure is a ``ValueError`` naming the keys and values at fault.

    python -m gtpo.launch.dry_run method=gtpo model=qwen2.5_7b      # the same through Hydra's compose API

The module imports verl lazily, so ``import gtpo.launch.dry_run`` stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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


def _checkpoint_engine_line(cfg: DictConfig) -> str:
    """Which transport the checkpoint engine imports and whether it imports on this machine."""
    from gtpo.launch.checks import ENGINE_MODULES, check_checkpoint_engine

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
    """What the run resumes from. ``resume_mode=resume_path`` under ``trainer.val_only`` (scripts/eval_checkpoint.sh)
    evaluates that checkpoint, so it must be here and complete
    (:func:`gtpo.trainer.resume.checkpoints.incomplete_reasons`); a training resume is only reported (this machine may
    not see the cluster's folder)."""
    from gtpo.launch.batch_checks import verl_mode
    from gtpo.trainer.resume.checkpoints import incomplete_reasons, layout_of, newest_complete

    trainer = cfg.trainer
    layout = layout_of(cfg, use_critic, verl_mode(str(trainer.v1.trainer_mode)) != "sync")
    mode = str(trainer.get("resume_mode"))
    if mode == "auto" and trainer.get("default_local_dir"):
        found = newest_complete(os.path.abspath(str(trainer.default_local_dir)), layout)
        return f"resume: trainer.resume_mode=auto continues {found[1]} (step {found[0]})" if found else None
    if mode != "resume_path" or not trainer.get("resume_from_path"):
        return None
    folder = os.path.abspath(str(trainer.resume_from_path))
    step = re.fullmatch(r"global_step_(\d+)", os.path.basename(folder))
    if not os.path.isdir(folder):
        problem = "no such folder here"
    elif step is None:
        problem = "not a checkpoint folder global_step_<N>"
    else:
        reasons = incomplete_reasons(folder, int(step.group(1)), layout)
        problem = f"incomplete checkpoint: {', '.join(reasons)}" if reasons else ""
    if not problem:
        return f"resume: trainer.resume_from_path={folder}, a complete checkpoint" + _evaluation_copy_note(cfg, folder)
    if trainer.get("val_only", False):
        raise ValueError(f"trainer.resume_from_path={folder}: {problem} (trainer.val_only=true evaluates it)")
    return f"resume: trainer.resume_from_path={folder}: {problem}; the trainer checks it again before loading"


def _evaluation_copy_note(cfg: DictConfig, folder: str) -> str:
    """An evaluation of a checkpoint saved at another world size loads a resharded copy of its own
    (:func:`gtpo.launch.checks.reshard_evaluation_copy`): where, said before the run makes it."""
    from gtpo.trainer.resume.checkpoint_world_size import checkpoint_world_size, run_world_size

    saved, run = checkpoint_world_size(folder), run_world_size(cfg.trainer)
    if not cfg.trainer.get("val_only", False) or saved in (None, run):
        return ""
    copy = os.path.join(os.path.abspath(str(cfg.trainer.default_local_dir)), "resharded", os.path.basename(folder))
    return f" saved at world size {saved}: evaluated through a copy resharded to {run} in {copy}, never in place"


def _plan_lines(cfg: DictConfig, plan: dict, use_ref: bool, use_critic: bool) -> list[str]:
    """The run's plan: method, resources, batch, validation, run length."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    lines = [
        f"method: adv_estimator={cfg.algorithm.adv_estimator} loss_mode={actor.policy_loss.loss_mode} "
        f"loss_agg_mode={actor.loss_agg_mode} clip=({actor.clip_ratio_low}, {actor.clip_ratio_high}) "
        f"use_kl_loss={actor.use_kl_loss} use_kl_in_reward={cfg.algorithm.use_kl_in_reward} "
        f"reference_policy={use_ref} critic={use_critic} trainer_mode={cfg.trainer.v1.trainer_mode}"
    ]
    nodes, gpus, tp = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, rollout.tensor_model_parallel_size
    pool = plan["rollout_pool"]
    parallel = f"ulysses sp={plan['sp']} -> dp={plan['dp']}"
    if pool is None:
        lines.append(
            f"resources: {nodes} node(s) x {gpus} GPU(s) = {plan['n_gpus']}; {parallel}; "
            f"vLLM replicas={plan['rollout_replicas']} (tp={tp})"
        )
    else:
        hybrid = bool(cfg.actor_rollout_ref.get("hybrid_engine", True))
        replica = plan["n_gpus"] // plan["rollout_replicas"]
        lines.append(
            f"resources: trainer {nodes} node(s) x {gpus} GPU(s) = {plan['n_gpus']} ({parallel}; vLLM replicas there: "
            f"{plan['rollout_replicas'] if hybrid else 'none, hybrid_engine=false'}) + standalone rollout pool "
            f"{pool[0]} node(s) x {pool[1]} GPU(s) (vLLM replicas={pool[0] * pool[1] // replica}, tp={tp}): "
            f"{nodes + pool[0]} GPU nodes, or fewer where a node holds a trainer and a pool share"
        )
    lines.append(
        f"batch: {cfg.data.train_batch_size} prompts x n={rollout.n} = {plan['sequences_per_step']} sequences/step in "
        f"{plan['mini_batches_per_step']} mini-batch(es) of {plan['sequences_per_rank_per_mini_batch']} sequences "
        f"per dp rank; max sequence {plan['max_seq_len']} tokens; dynamic_bsz={plan['dynamic_bsz']}"
    )
    val, trainer = rollout.val_kwargs, cfg.trainer
    lines.append(
        f"validation: {cfg.data.val_files} n={val.n} temperature={val.temperature} top_p={val.top_p} "
        f"do_sample={val.do_sample}; test_freq={trainer.test_freq} val_before_train={trainer.val_before_train} "
        f"val_only={trainer.val_only}"
    )
    steps, epochs, bsz = trainer.total_training_steps, trainer.total_epochs, int(cfg.data.train_batch_size)
    if steps is not None:
        per_epoch = -(-int(steps) // max(int(epochs), 1))
        lines.append(
            f"run length: trainer.total_training_steps={steps}; verl stops earlier if trainer.total_epochs={epochs} "
            f"epochs end first, i.e. with fewer than {per_epoch} x {bsz} = {per_epoch * bsz:,} training prompts (the "
            "preflight counts them)"
        )
    else:
        lines.append(f"run length: trainer.total_epochs={epochs} x (training prompts // {bsz}) steps")
    return lines


def run_dry(config: DictConfig, checked=None) -> None:
    """Print what :func:`gtpo.launch.checks.check_config` found (``checked``; run here when not given): the verdict
    and the plan first, the resolved configuration last. Never starts Ray or touches an accelerator; ``config`` is
    left untouched.

    Raises:
        ValueError: for the first problem found, naming the offending keys and values.
    """
    from gtpo.launch.batch_checks import startup_notes
    from gtpo.launch.checks import check_config
    from gtpo.launch.gpu_peak import peak_lines
    from gtpo.launch.memory_estimate import memory_lines
    from gtpo.launch.runs import facts, run_identity
    from gtpo.launch.state_memory import state_lines

    checked = checked if checked is not None else check_config(config)
    cfg = checked.config
    resume = _resume_line(cfg, checked.use_critic)
    run = run_identity(os.environ)
    named = f"run {run['name']}: " if run else ""

    lines = _plan_lines(cfg, checked.plan, checked.use_reference_policy, checked.use_critic)
    lines += [resume] if resume else []
    lines += memory_lines(cfg) + state_lines(cfg) + peak_lines(cfg) + [_checkpoint_engine_line(cfg)]
    lines += [f"note: {note}" for note in startup_notes(cfg)]
    buffer = OmegaConf.select(cfg, "reward.reward_kwargs.overlong_buffer_cfg", default=None)
    if buffer is not None and buffer.get("enable", False):
        max_len = cfg.reward.reward_kwargs.max_resp_len
        lines.append(
            f"overlong punishment: buffer {buffer.len} of {max_len} tokens (penalty from token "
            f"{max_len - buffer.len}, -{buffer.penalty_factor} at {max_len})"
        )
    print(f"[dry run] OK: {named}{facts(cfg)}; resolved and validated, Ray was not started (resolved config below)")
    for line in lines:
        print(f"[dry run] {line}")
    print(BEGIN_MARK)
    print(OmegaConf.to_yaml(cfg, sort_keys=False).rstrip())
    print(END_MARK)
    if checked.verl_output:
        print(checked.verl_output)


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
    except (ValueError, RuntimeError) as err:
        print(f"[dry run] FAILED: {err}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
