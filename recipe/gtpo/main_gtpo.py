"""Entry point of the gtpo recipe: verl 0.9.1's v1 PPO trainer with the recipe's plugin in every Ray process.

    python -m recipe.gtpo.main_gtpo method=gtpo model=qwen2.5_7b data.train_files=... [overrides]
    DRY_RUN=1 python -m recipe.gtpo.main_gtpo ...   # resolve + validate + print, no Ray, no GPU

Compared with ``verl.trainer.main_ppo`` this entry point (1) runs every check before Ray starts
(:mod:`gtpo.launch.checks`) and, naming no cluster, starts a private one of its own (:mod:`gtpo.launch.local_ray`),
(2) puts ``gtpo.verl_plugin.register`` into ``VERL_USE_EXTERNAL_MODULES`` of the Ray
runtime env, so multi-node workers that do not inherit the driver's shell still register the estimators, losses and
trainer mode, and copies the driver's log folders (:data:`LOG_DIR_VARS`) there too, so the TaskRunner writes its
logs where the launcher put them, and closes vLLM's HTTP API to what verl does not use
(:mod:`gtpo.verl_plugin.vllm_http`), and (3) runs a TaskRunner that imports the plugin itself before building the
trainer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import hydra
import ray
from omegaconf import DictConfig, open_dict
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
from verl.utils.device import auto_set_device

from gtpo.launch.launcher import PLUGIN_MODULE
from gtpo.launch.local_ray import ClusterInUseError, refuse_a_cluster_in_use, start_private_local_ray
from gtpo.launch.submit import LOG_DIR_VARS
from gtpo.methods import knob
from gtpo.trainer.guard.watchdog import EXIT_CODE as STALLED_EXIT
from gtpo.trainer.guard.watchdog import StageTimeoutError
from gtpo.trainer.preemption.channel import recorded_stall
from gtpo.trainer.preemption.driver import DriverRelay
from gtpo.trainer.preemption.stop import EXIT_CODE as PREEMPTED_EXIT
from gtpo.trainer.preemption.stop import PreemptedError
from gtpo.verl_plugin.config import merge_module_list

# Exit status of a configuration refused before Ray starts (GTPO_TRACEBACK=1 raises it with its traceback instead).
CONFIG_ERROR_EXIT = 2
# The job's end for algorithm.preemption.deadline=auto, read by the trainer wherever the TaskRunner runs.
DEADLINE_VARS = ("SLURM_JOB_ID", "SLURM_JOB_END_TIME")

logger = logging.getLogger(__name__)


def _runtime_env_vars(config: DictConfig) -> DictConfig:
    """``ray_kwargs.ray_init.runtime_env.env_vars``, created where missing (a DictConfig's ``setdefault`` returns the
    plain default it stored, not the node, so writes into it would be lost)."""
    node = config.ray_kwargs
    with open_dict(config):
        for key in ("ray_init", "runtime_env", "env_vars"):
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
    return node


def add_plugin_to_runtime_env(config: DictConfig) -> None:
    """Make ``VERL_USE_EXTERNAL_MODULES`` in the Ray runtime env (and this process) include the plugin.

    Keeps whatever modules the user or the runtime env already lists (e.g. the CPU backend's).
    """
    env_vars = _runtime_env_vars(config)
    with open_dict(config):
        modules = merge_module_list(
            env_vars.get("VERL_USE_EXTERNAL_MODULES"), os.environ.get("VERL_USE_EXTERNAL_MODULES"), PLUGIN_MODULE
        )
        env_vars["VERL_USE_EXTERNAL_MODULES"] = modules
    os.environ["VERL_USE_EXTERNAL_MODULES"] = modules


def forward_log_dirs(config: DictConfig) -> None:
    """Copy the :data:`LOG_DIR_VARS` and :data:`DEADLINE_VARS` set in this process into the Ray runtime env, unless the
    runtime env sets them."""
    env_vars = _runtime_env_vars(config)
    with open_dict(config):
        for name in LOG_DIR_VARS + DEADLINE_VARS:
            if os.environ.get(name) and not env_vars.get(name):
                env_vars[name] = os.environ[name]


def narrow_vllm_http(config: DictConfig) -> None:
    """Put :func:`gtpo.verl_plugin.vllm_http.runtime_env_vars` into the Ray runtime env: no LoRA adapter loaded over
    vLLM's HTTP API, and that API closed to everyone unless a reward model served by vLLM needs it."""
    from gtpo.verl_plugin.vllm_http import runtime_env_vars

    env_vars = _runtime_env_vars(config)
    with open_dict(config):
        env_vars.update(runtime_env_vars(config, env_vars))


class GTPOTaskRunner(TaskRunnerV1.__ray_actor_class__):
    """verl's v1 TaskRunner, importing the plugin first so ``gtpo_sync`` and the estimators exist in this actor."""

    def run(self, config: DictConfig):
        import gtpo.verl_plugin.register  # noqa: F401

        return super().run(config)


def prepare_config(config: DictConfig, dry_run: bool = False):
    """Everything that must pass before Ray starts (:func:`gtpo.launch.checks.check_config`, once), then the plugin
    env and the log folders; returns what the checks found, which the dry run prints.

    A real run (``dry_run=False``) also checks that a driver joining a running cluster carries its Ray token, runs
    :func:`gtpo.launch.checks.prepare_launch` (the checkpoint engine's transport, the checkpoint a resume loads, the
    run's record in its folder) and logs the startup notes; the dry run prints those itself.
    """
    from gtpo.launch.batch_checks import startup_notes
    from gtpo.launch.checks import check_config, prepare_launch
    from gtpo.launch.ray_auth import check_ray_auth

    auto_set_device(config)
    forward_log_dirs(config)  # before the checks: the dry run prints the config they resolved
    checked = check_config(config)
    if not dry_run:
        check_ray_auth()
        prepare_launch(config, checked)
        for note in startup_notes(checked.config):
            logger.warning("gtpo: %s", note)
    add_plugin_to_runtime_env(config)
    narrow_vllm_http(config)
    return checked


def _dry_run_requested() -> bool:
    return os.environ.get("DRY_RUN", "0").lower() in ("1", "true", "yes")


@hydra.main(config_path="config", config_name="gtpo_trainer", version_base=None)
def run_recipe(config: DictConfig) -> None:
    """The composed config: checked (and, under DRY_RUN, printed by gtpo.launch.dry_run), then trained."""
    import gtpo.verl_plugin.register  # noqa: F401  (registers in the driver too: validation looks names up)

    dry_run = _dry_run_requested()
    try:
        checked = prepare_config(config, dry_run=dry_run)
        if dry_run:
            from gtpo.launch.dry_run import run_dry

            run_dry(config, checked)
    except ValueError as err:
        # a bad value on the command line or in a preset: one line naming it, no traceback unless asked for
        if os.environ.get("GTPO_TRACEBACK", "0") == "1":
            raise
        print(f"gtpo: invalid configuration: {err}", file=sys.stderr)
        sys.exit(CONFIG_ERROR_EXIT)
    if dry_run:
        return
    sys.exit(train(config))


def main() -> None:
    """``python -m recipe.gtpo.main_gtpo [overrides]``: Hydra composes the config for :func:`run_recipe`.

    A composition error (a key the config lacks, a preset that does not exist, an override that does not parse) is
    one line naming it and the valid names, exit :data:`CONFIG_ERROR_EXIT` (GTPO_TRACEBACK=1: the traceback). A dry
    run's Hydra folder goes to a temporary folder, so it leaves no ``outputs/<date>/<time>/`` in the checkout.
    """
    from gtpo.launch.dry_run import config_error_line, scratch_run_dir

    # Unset, Hydra reports a composition error itself (a traceback ending in advice to add `+`, the wrong fix for a
    # misspelt key); set, it re-raises it here. Errors after composition keep their full traceback, as under the
    # launchers, which always set it.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with scratch_run_dir(sys.argv) if _dry_run_requested() else contextlib.nullcontext():
            run_recipe()
    except Exception as err:
        line = config_error_line(err)
        if line is None or os.environ.get("GTPO_TRACEBACK", "0") == "1":
            raise
        print(f"gtpo: invalid configuration: {line}", file=sys.stderr)
        sys.exit(CONFIG_ERROR_EXIT)


class HandlersAfterRayInit:
    """The TaskRunner class handed to verl's ``run_ppo`` (its ``task_runner_class``, the recipes' hook), installing
    ``relay``'s signal handlers again as the runner is created.

    ``run_ppo`` creates the runner (``.remote()``, or ``.options(...).remote()`` under nsys) right after its
    ``ray.init``, which replaces SIGTERM's handler with one that exits the driver at once, and before it waits on
    the run: the handlers set here are the ones in place while the driver waits. It is also the first moment the
    driver is on the cluster and no TaskRunner exists: a cluster another verl run lives on is refused there
    (:func:`gtpo.launch.local_ray.refuse_a_cluster_in_use`).
    """

    def __init__(self, actor_class, relay: DriverRelay):
        self.actor_class = actor_class
        self.relay = relay

    def options(self, **kwargs) -> HandlersAfterRayInit:
        return HandlersAfterRayInit(self.actor_class.options(**kwargs), self.relay)

    def remote(self, *args, **kwargs):
        refuse_a_cluster_in_use()
        self.relay.install()
        return self.actor_class.remote(*args, **kwargs)


def train(config: DictConfig) -> int:
    """A checked config's run: a private local Ray of its own when it names no cluster (never the one a file in
    ``<tmp>/ray`` records: :mod:`gtpo.launch.local_ray`), then verl's trainer (:func:`run_preemptible`)."""
    start_private_local_ray(config.ray_kwargs.get("ray_init") or {})
    return run_preemptible(config)


def run_preemptible(config: DictConfig) -> int:
    """verl's ``run_ppo`` with the stop signals relayed to the trainer; 0, :data:`PREEMPTED_EXIT` after the
    trainer saved and stopped, :data:`STALLED_EXIT` after the stage watchdog ended a stalled stage, or
    :data:`CONFIG_ERROR_EXIT` on a Ray cluster another verl run lives on."""
    relay = DriverRelay(knob(config.algorithm, "preemption"))
    relay.install()  # until verl's ray.init; HandlersAfterRayInit installs them again after it
    try:
        run_ppo(config, task_runner_class=HandlersAfterRayInit(ray.remote(GTPOTaskRunner), relay))
    except ClusterInUseError as err:
        print(f"gtpo: {err}", file=sys.stderr, flush=True)
        return _exiting(CONFIG_ERROR_EXIT, "the Ray cluster runs another verl job")
    except PreemptedError as err:
        # Ray hands back the trainer's exception wrapped with its remote traceback; the message is the news
        print(str(getattr(err, "cause", err)), file=sys.stderr, flush=True)
        return _exiting(PREEMPTED_EXIT, "saved for a stop; trainer.resume_mode=auto continues")
    except StageTimeoutError as err:
        print(str(getattr(err, "cause", err)), file=sys.stderr, flush=True)
        return _exiting(STALLED_EXIT, "a stage stalled: algorithm.watchdog")
    except ray.exceptions.RayActorError:
        # the watchdog ended the trainer's process itself (os._exit after grace_s): only its record says so
        stall = _recorded_stall()
        if stall is None:
            raise
        print(f"{stall}; the trainer process exited with status {STALLED_EXIT}", file=sys.stderr, flush=True)
        return _exiting(STALLED_EXIT, "a stage stalled: algorithm.watchdog")
    return 0


def _exiting(code: int, why: str) -> int:
    """``code``, announced in the line ``python -m gtpo.launch.job_exit`` reads back after ``ray job stop`` (Ray
    records no exit code for a stopped job)."""
    from gtpo.launch.job_exit import exit_line

    print(exit_line(code, why), file=sys.stderr, flush=True)
    return code


def _recorded_stall() -> str | None:
    """The stage watchdog's record for this driver's Ray job, or None (also when the cluster cannot tell)."""
    from gtpo.trainer.preemption.channel import current_job_id

    try:
        return recorded_stall(current_job_id())
    except Exception:  # noqa: BLE001 - the actor's own error is the one to show then
        return None


if __name__ == "__main__":
    main()
