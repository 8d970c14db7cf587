"""Entry point of the gtpo recipe: verl 0.9.1's v1 PPO trainer with the recipe's plugin in every Ray process.

    python -m recipe.gtpo.main_gtpo method=gtpo model=qwen2.5_7b data.train_files=... [overrides]
    DRY_RUN=1 python -m recipe.gtpo.main_gtpo ...   # resolve + validate + print, no Ray, no GPU

Compared with ``verl.trainer.main_ppo`` this entry point (1) validates the recipe's knob blocks before anything
is allocated, (2) puts ``gtpo.verl_plugin.register`` into ``VERL_USE_EXTERNAL_MODULES`` of the Ray runtime env, so
multi-node workers that do not inherit the driver's shell still register the estimators, losses and trainer
mode, and copies the driver's log folders (:data:`LOG_DIR_VARS`) there too, so the TaskRunner writes its logs where
the launcher put them, and (3) runs a TaskRunner that imports the plugin itself before building the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

import hydra
import ray
from omegaconf import DictConfig, open_dict
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from gtpo.trainer.preemption import EXIT_CODE as PREEMPTED_EXIT
from gtpo.trainer.preemption import DriverRelay, PreemptedError, params_of
from gtpo.verl_plugin.config import merge_module_list

PLUGIN_MODULE = "gtpo.verl_plugin.register"
# Exit status of a configuration refused before Ray starts (GTPO_TRACEBACK=1 raises it with its traceback instead).
CONFIG_ERROR_EXIT = 2
# Where verl's file logger, TensorBoard and W&B write (scripts/common.sh sets them under CKPTS_DIR). The TaskRunner
# writes the logs; on a running cluster it sees the runtime env, not the driver's shell, and verl's relative
# defaults would put the logs in its node's scratch copy of the working directory.
LOG_DIR_VARS = ("VERL_FILE_LOGGER_ROOT", "VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_DIR")
# The job's end for algorithm.preemption.deadline=auto, read by the trainer wherever the TaskRunner runs.
DEADLINE_VARS = ("SLURM_JOB_ID", "SLURM_JOB_END_TIME")

logger = logging.getLogger(__name__)


def add_plugin_to_runtime_env(config: DictConfig) -> None:
    """Make ``VERL_USE_EXTERNAL_MODULES`` in the Ray runtime env (and this process) include the plugin.

    Keeps whatever modules the user or the runtime env already lists (e.g. the CPU backend's).
    """
    with open_dict(config):
        ray_init = config.ray_kwargs.setdefault("ray_init", {})
        runtime_env = ray_init.setdefault("runtime_env", {})
        env_vars = runtime_env.setdefault("env_vars", {})
        modules = merge_module_list(
            env_vars.get("VERL_USE_EXTERNAL_MODULES"), os.environ.get("VERL_USE_EXTERNAL_MODULES"), PLUGIN_MODULE
        )
        env_vars["VERL_USE_EXTERNAL_MODULES"] = modules
    os.environ["VERL_USE_EXTERNAL_MODULES"] = modules


def forward_log_dirs(config: DictConfig) -> None:
    """Copy the :data:`LOG_DIR_VARS` and :data:`DEADLINE_VARS` set in this process into the Ray runtime env, unless the
    runtime env sets them."""
    with open_dict(config):
        ray_init = config.ray_kwargs.setdefault("ray_init", {})
        env_vars = ray_init.setdefault("runtime_env", {}).setdefault("env_vars", {})
        for name in LOG_DIR_VARS + DEADLINE_VARS:
            if os.environ.get(name) and not env_vars.get(name):
                env_vars[name] = os.environ[name]


class GTPOTaskRunner(TaskRunnerV1.__ray_actor_class__):
    """verl's v1 TaskRunner, importing the plugin first so ``gtpo_sync`` and the estimators exist in this actor."""

    def run(self, config: DictConfig):
        import gtpo.verl_plugin.register  # noqa: F401

        return super().run(config)


def prepare_config(config: DictConfig, dry_run: bool = False) -> None:
    """Everything that must pass before Ray starts: recipe knobs, verl's own validation, no CPU test backend on a
    GPU run, the plugin env and the log folders.

    A real run (``dry_run=False``) also checks that this environment imports the checkpoint engine's transport
    (cupy for ``nccl``), that a resume finds its checkpoint at this world size (where the driver sees the folder),
    and logs the startup notes; the dry run prints those itself, on a machine that is usually not the cluster's
    image.
    """
    from gtpo.launch.async_checks import check_checkpoint_engine, startup_notes, verl_mode
    from gtpo.launch.validation import validate_recipe_config
    from gtpo.trainer.checkpoint_world_size import check_world_size_before_launch
    from gtpo.trainer.checkpoints import layout_of
    from gtpo.trainer.startup_checks import check_cpu_backend

    auto_set_device(config)
    check_cpu_backend(config)
    validate_recipe_config(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if not dry_run:
        check_checkpoint_engine(config)
        async_mode = verl_mode(str(config.trainer.v1.trainer_mode)) != "sync"
        check_world_size_before_launch(config.trainer, layout_of(config, need_critic(config), async_mode))
        for note in startup_notes(config):
            logger.warning("gtpo: %s", note)
    add_plugin_to_runtime_env(config)
    forward_log_dirs(config)


@hydra.main(config_path="config", config_name="gtpo_trainer", version_base=None)
def main(config: DictConfig) -> None:
    import gtpo.verl_plugin.register  # noqa: F401  (registers in the driver too: validation looks names up)

    dry_run = os.environ.get("DRY_RUN", "0").lower() in ("1", "true", "yes")
    try:
        prepare_config(config, dry_run=dry_run)
    except ValueError as err:
        # a bad value on the command line or in a preset: one line naming it, no traceback unless asked for
        if os.environ.get("GTPO_TRACEBACK", "0") == "1":
            raise
        print(f"gtpo: invalid configuration: {err}", file=sys.stderr)
        sys.exit(CONFIG_ERROR_EXIT)
    if dry_run:
        from gtpo.launch.dry_run import run_dry

        run_dry(config)
        return
    sys.exit(run_preemptible(config))


@contextlib.contextmanager
def handlers_after_ray_init(relay: DriverRelay):
    """``relay``'s signal handlers installed now and again right after ``ray.init`` (called inside verl's
    ``run_ppo``), which replaces SIGTERM's handler with one that exits the driver at once."""
    original = ray.init

    @functools.wraps(original)
    def init(*args, **kwargs):
        context = original(*args, **kwargs)
        relay.install()
        return context

    relay.install()
    ray.init = init
    try:
        yield relay
    finally:
        ray.init = original


def run_preemptible(config: DictConfig) -> int:
    """verl's ``run_ppo`` with the stop signals relayed to the trainer; 0, or :data:`PREEMPTED_EXIT` after the
    trainer saved and stopped."""
    with handlers_after_ray_init(DriverRelay(params_of(config.algorithm))):
        try:
            run_ppo(config, task_runner_class=ray.remote(GTPOTaskRunner))
        except PreemptedError as err:
            # Ray hands back the trainer's exception wrapped with its remote traceback; the message is the news
            print(str(getattr(err, "cause", err)), file=sys.stderr, flush=True)
            return PREEMPTED_EXIT
    return 0


if __name__ == "__main__":
    main()
