"""The one launcher: ``bash scripts/run.sh METHOD MODEL [adapter=NAME] [overrides]`` (``python -m gtpo.launch``).

Every hyperparameter comes from the presets (``configs/method/<METHOD>.yaml``, ``configs/model/<MODEL>.yaml`` with
its node and GPU counts, ``adapter=`` and its per-model piece); this module adds where things are (data, model,
checkpoints, logs), the run's name, and in-loop validation at paper A's sampling with n = 4. The name is
``<method>-<model>[-<adapter>]`` plus each override that changes what is trained (:meth:`gtpo.launch.runs.Run.name`),
so an ablation never continues another run's checkpoints; the entry point refuses a folder that holds another run
(:func:`gtpo.launch.checks.check_run_folder`). The published ``scripts/run_<method>_<model>.sh`` call this with
their two names. ``--smoke`` is the smoke run: two phases (steps 1-2 from scratch, a resume to step 4) and a check.

A launcher mistake (an unknown method or model, one another launcher has, a missing per-model piece, an environment
variable given as an argument, a Slurm allocation of another size than the run's, a model folder of another model
than the preset's, a path other nodes cannot read)
is one line naming it and what fits, exit 2, before Python imports verl. Then, by ``DRY_RUN`` / ``PREFLIGHT`` /
``SUBMIT_MODE``: the dry run, the preflight, the training run here, or a Ray job (:mod:`gtpo.launch.submit`).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gtpo.launch.runs import (
    REPO_ROOT,
    RUN_ENV,
    Run,
    default_choice,
    fitting_launcher,
    missing_piece,
    preset_counts,
    presets,
    published_script,
    read_preset,
)
from gtpo.launch.submit import LOG_DIR_VARS, LaunchError, check_paths, cluster_reason, run_here, submit_job, submit_mode

__all__ = ["ENTRYPOINT", "LOG_DIR_VARS", "PLUGIN_MODULE", "Plan", "main", "plan"]

PLUGIN_MODULE = "gtpo.verl_plugin.register"
ENTRYPOINT = "recipe.gtpo.main_gtpo"
LAUNCH_ERROR_EXIT = 2
# In-loop validation of every run: paper A's sampling at n = 4 (Table 1's n = 32 runs offline on saved checkpoints:
# scripts/eval_checkpoint.sh); the smoke run validates at n = 2.
VALIDATION = ("sampling=paper", "actor_rollout_ref.rollout.val_kwargs.n=4")
SMOKE = ("scale=smoke", "sampling=paper", "actor_rollout_ref.rollout.val_kwargs.n=2", "trainer.save_freq=2")
# The smoke run's phases: steps 1..2 from scratch, then a resume from the checkpoint the tracker names to step 4.
SMOKE_PHASES = (("trainer.total_training_steps=2", "trainer.resume_mode=disable"),
                ("trainer.total_training_steps=4", "trainer.resume_mode=auto"))  # fmt: skip
ENV_ARG = re.compile(r"^[A-Z][A-Z0-9_]*=")
TRUE = ("1", "true", "yes")


def _usage() -> str:
    from gtpo.methods import METHODS

    lines = ["usage: bash scripts/run.sh METHOD MODEL [adapter=NAME] [Hydra overrides]   (gtpo/launch/launcher.py)",
             "       bash scripts/run_<method>_<model>.sh [Hydra overrides]             (the published runs)", "",
             "methods (gtpo.methods.METHODS):"]  # fmt: skip
    lines += [f"  {row.name:<14} {row.paper}" for row in METHODS.values()]
    lines.append("models (configs/model/, nodes x GPUs):")
    for model in presets("model"):
        nodes, gpus = preset_counts(model, None, (), {})
        lines.append(f"  {model:<14} {nodes} x {gpus}, {Path(str(_hub_id(model))).name}")
    for adapter in presets("adapter"):
        sized = [m for m in presets("model") if missing_piece("adapter", adapter, m) is None]
        lines.append(f"adapter={adapter}: for {', '.join(sized)} (configs/adapter/model/{adapter}_<model>.yaml)")
    for agent in presets("agent"):
        lines.append(f"agent={agent}: verl's multi-turn tool loop (configs/agent/{agent}.yaml, docs/tool-use.md)")
    scripts = sorted(p.name for p in (REPO_ROOT / "scripts").glob("run_*.sh") if "/run.sh" in p.read_text())
    lines += ["published runs (scripts/):", *(f"  {name}" for name in scripts), ""]
    lines += [
        "environment: DRY_RUN=1 (resolve and check, no Ray), PREFLIGHT=1 (the cluster's checks), RAY_DATA_HOME",
        "(data/, models/, ckpts/; default $HOME/verl), TRAIN_FILE, TEST_FILE, MODEL_PATH, PROJECT_NAME, EXP_NAME,",
        "CKPTS_DIR, NNODES / NGPUS_PER_NODE (instead of the model preset's counts), RAY_ADDRESS, SUBMIT_MODE",
        "(auto|local|job), JOB_NO_WAIT, ENV_PASSTHROUGH, ALLOW_HOME_PATHS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH,",
        "ENTRYPOINT (the driver module), GTPO_TRACE=1 (print the commands run); docs/cluster.md",
    ]
    return "\n".join(lines)


def _hub_id(model: str) -> str:
    return (read_preset("model", model).get("actor_rollout_ref") or {}).get("model", {}).get("path", model)


def _refuse_conflict(group: str, value: str, run: Run) -> None:
    mine = getattr(run, group)
    valid = presets(group) if group != "method" else _method_names()
    if value not in valid:
        raise LaunchError(f"{group}={value}: no such {group}; valid: {', '.join(valid)}")
    wanted = {"method": run.method, "model": run.model, "adapter": run.adapter, group: value}
    launcher = fitting_launcher(wanted["method"], wanted["model"], wanted["adapter"])
    missing = wanted["adapter"] and missing_piece("adapter", wanted["adapter"], wanted["model"])
    raise LaunchError(
        f"{group}={value} on the command line of {fitting_launcher(run.method, run.model, run.adapter)}, a launcher "
        f"for {group}={mine}: its run name and checkpoint folder are those of {group}={mine}; "
        + (missing if missing else f"use {launcher}")
    )


def _method_names() -> list[str]:
    from gtpo.methods import METHODS

    return list(METHODS)


def parse(argv: Sequence[str]) -> Run:
    """``[--smoke] METHOD MODEL [overrides]`` as a :class:`~gtpo.launch.runs.Run`; mistakes raise LaunchError."""
    args = list(argv)
    smoke = args[:1] == ["--smoke"]
    args = args[1:] if smoke else args
    if len(args) < 2 or "=" in args[0] or "=" in args[1]:
        raise LaunchError("expected METHOD MODEL before the overrides: bash scripts/run.sh METHOD MODEL [overrides] "
                          "(bash scripts/run.sh --help lists them)")  # fmt: skip
    method, model, overrides = args[0], args[1], args[2:]
    if method not in _method_names():
        raise LaunchError(f"method={method}: no such method; valid: {', '.join(_method_names())}")
    if model not in presets("model"):
        raise LaunchError(f"model={model}: no such model preset (configs/model/); valid: {', '.join(presets('model'))}")
    adapter = None
    for override in overrides:
        if override.startswith("adapter="):
            adapter = override.partition("=")[2]
            if adapter not in presets("adapter"):
                raise LaunchError(f"adapter={adapter}: no such adapter; valid: {', '.join(presets('adapter'))}")
    run = Run(method, model, adapter, tuple(o for o in overrides if not o.startswith("adapter=")), smoke)
    for override in overrides:
        if ENV_ARG.match(override):
            smoke_script = smoke and published_script("smoke", run.model)
            invoked = f"bash {smoke_script}" if smoke_script else fitting_launcher(run.method, run.model, run.adapter)
            raise LaunchError(
                f"{override}: an environment variable of the launcher, not a Hydra override; set it before the "
                f"command: {override} {invoked} ..."
            )
        group, _, value = override.lstrip("+").partition("=")
        if group == "method" and smoke and value in _method_names():
            run = Run(value, run.model, run.adapter, run.overrides, smoke)
        elif group in ("method", "model") and value != getattr(run, group):
            _refuse_conflict(group, value, run)
    scale = next((o.partition("=")[2] for o in reversed(run.overrides) if o.startswith("scale=")), None)
    for group, choice in (("scale", scale or ("smoke" if smoke else None)), ("adapter", run.adapter)):
        problem = choice and missing_piece(group, choice, run.model)
        if problem:
            raise LaunchError(problem)
    return run


class Plan:
    """A run's name, paths, overrides and environment, as ``environ`` and the presets make them."""

    def __init__(self, run: Run, environ: Mapping[str, str]):
        self.run, home = run, environ.get("HOME", "")
        data = environ.get("RAY_DATA_HOME") or f"{home}/verl"
        self.name = environ.get("EXP_NAME") or run.name()
        project = environ.get("PROJECT_NAME") or ("gtpo-smoke" if run.smoke else "gtpo-reproduction")
        tests = ",".join(f"{data}/data/{name}.parquet" for name in ("aime2024", "aime2025", "math500"))
        self.paths = {
            "TRAIN_FILE": environ.get("TRAIN_FILE") or f"{data}/data/dapo_math_17k.parquet",
            "TEST_FILE": environ.get("TEST_FILE") or f"[{tests}]",
            "MODEL_PATH": environ.get("MODEL_PATH") or f"{data}/models/{Path(str(_hub_id(run.model))).name}",
            "CKPTS_DIR": environ.get("CKPTS_DIR") or f"{data}/ckpts/{project}/{self.name}",
        }
        self.nnodes, self.gpus = preset_counts(run.model, run.adapter, run.overrides, environ)
        counts = [f"trainer.{k}={environ[v]}" for k, v in (("nnodes", "NNODES"), ("n_gpus_per_node", "NGPUS_PER_NODE"))
                  if environ.get(v)]  # fmt: skip
        self.infrastructure = [
            f"data.train_files={self.paths['TRAIN_FILE']}",
            f"data.val_files={self.paths['TEST_FILE']}",
            f"actor_rollout_ref.model.path={self.paths['MODEL_PATH']}",
            *counts,
            f"trainer.project_name={project}",
            f"trainer.experiment_name={self.name}",
            f"trainer.default_local_dir={self.paths['CKPTS_DIR']}",
        ]
        presets_ = [f"method={run.method}", f"model={run.model}", *([f"adapter={run.adapter}"] if run.adapter else [])]
        self.overrides = [*self.infrastructure, *presets_, *(SMOKE if run.smoke else VALIDATION), *run.overrides]
        ckpts = self.paths["CKPTS_DIR"]
        self.environ = {
            **environ,
            "VERL_FILE_LOGGER_ROOT": environ.get("VERL_FILE_LOGGER_ROOT") or f"{ckpts}/logs",
            "TENSORBOARD_DIR": environ.get("TENSORBOARD_DIR") or f"{ckpts}/tensorboard",
            "WANDB_DIR": environ.get("WANDB_DIR") or ckpts,
            "HF_HUB_OFFLINE": environ.get("HF_HUB_OFFLINE") or "1",
            "TORCH_NCCL_AVOID_RECORD_STREAMS": environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS") or "1",
            "HYDRA_FULL_ERROR": environ.get("HYDRA_FULL_ERROR") or "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), environ.get("PYTHONPATH", "")) if p),
            "WORKING_DIR": environ.get("WORKING_DIR") or str(REPO_ROOT),
            "RUNTIME_ENV": environ.get("RUNTIME_ENV") or str(REPO_ROOT / "recipe" / "gtpo" / "runtime_env.yaml"),
            RUN_ENV: json.dumps(run.identity(self.name)),
        }
        from gtpo.verl_plugin.config import merge_module_list

        self.environ["VERL_USE_EXTERNAL_MODULES"] = merge_module_list(
            environ.get("VERL_USE_EXTERNAL_MODULES"), PLUGIN_MODULE
        )

    def check_allocation(self, environ: Mapping[str, str]) -> None:
        """Under ``scripts/slurm/ray_on_slurm.sbatch`` the trainer's share of the allocation (``ALLOCATION_NNODES``,
        ``ALLOCATION_GPUS_PER_NODE``) is the run's own count: never more nodes than the run uses, nor fewer."""
        counts = (("ALLOCATION_NNODES", "NNODES", "trainer.nnodes", self.nnodes, "node(s)", "--nodes"),
                  ("ALLOCATION_GPUS_PER_NODE", "NGPUS_PER_NODE", "trainer.n_gpus_per_node", self.gpus,
                   "GPU(s) per node", "--gpus-per-node"))  # fmt: skip
        for var, env, key, count, unit, flag in counts:
            given = environ.get(var)
            if given and int(given) != count:
                source = f"{env}={environ[env]}" if environ.get(env) else f"configs/model/{self.run.model}.yaml"
                if self.run.adapter and not environ.get(env):
                    source += f" with adapter={self.run.adapter}"
                has_pool = any("rollout.nnodes=" in o for o in self.run.overrides)
                pool = " + the rollout pool's nodes" if var == "ALLOCATION_NNODES" and has_pool else ""
                raise LaunchError(
                    f"{key}={count} ({source}) but this Slurm job gives the trainer {given} {unit} ({var}={given}): "
                    f"submit it with sbatch {flag}={count}{pool}, or set {env}={given} to train on {given}"
                )

    def check_model_folder(self) -> None:
        """The model folder holds the model the preset is sized for, by its ``config.json`` (when readable here): a
        preset's budgets, offload and vLLM share are another model's otherwise."""
        from gtpo.launch.state_memory import model_mismatch

        if any(o.startswith("backend=") for o in self.overrides):
            return  # the CPU test backend runs a preset's code paths on its tiny model, by design
        expected = Path(str(_hub_id(self.run.model))).name
        problem = model_mismatch(expected, self.paths["MODEL_PATH"])
        if problem:
            raise LaunchError(
                f"MODEL_PATH={self.paths['MODEL_PATH']}: {problem}, but model={self.run.model} is sized for "
                f"{expected}; set MODEL_PATH to a {expected} folder, or run the preset of that model (bash "
                "scripts/run.sh --help lists them)"
            )

    def pieces(self) -> list[str]:
        """The cross-product presets Hydra composes for this run (``optional`` in the recipe's defaults list)."""
        scale = next((o.partition("=")[2] for o in reversed(self.overrides) if o.startswith("scale=")), None)
        scale = scale or default_choice("scale")
        names = [f"scale/model/{scale}_{self.run.model}", f"scale/method/{scale}_{self.run.method}"]
        names += [f"adapter/model/{self.run.adapter}_{self.run.model}"] if self.run.adapter else []
        return [f"configs/{name}.yaml" for name in names if (REPO_ROOT / "configs" / f"{name}.yaml").is_file()]

    def describe(self) -> str:
        published = published_script(self.run.method, self.run.model, self.run.adapter)
        words = [f"[gtpo] run {self.name}: method={self.run.method} model={self.run.model}"]
        words += [f"adapter={self.run.adapter}"] if self.run.adapter else []
        words += [f"on {self.nnodes} node(s) x {self.gpus} GPU(s)"]
        words += [f"({published})"] if published and not self.run.changes else []
        details = [f"changes: {' '.join(self.run.changes)}"] if self.run.changes else []
        details += [f"pieces: {' '.join(self.pieces())}"] if self.pieces() else []
        return "; ".join([" ".join(words), *details, f"CKPTS_DIR={self.paths['CKPTS_DIR']}"])


def plan(argv: Sequence[str], environ: Mapping[str, str]) -> Plan:
    """The checked plan of ``argv`` (:func:`parse`) in ``environ``; mistakes raise LaunchError."""
    return Plan(parse(argv), environ)


def _launch(p: Plan, phase: Sequence[str], mode: str, last: bool) -> int:
    """One trainer run (the smoke run has two): the dry run, the preflight, here, or as a Ray job."""
    environ, python = dict(p.environ), p.environ.get("PYTHON") or sys.executable
    module = environ.get("ENTRYPOINT") or ENTRYPOINT  # another driver module: the tests' stand-in drivers
    if environ.get("DRY_RUN", "0").lower() in TRUE:
        environ["DRY_RUN"] = "1"
    elif environ.get("PREFLIGHT", "0").lower() in TRUE:
        module = "gtpo.launch.preflight"
    args = ["-m", module, *p.overrides, *phase]
    if mode == "job" and environ.get("DRY_RUN") != "1":
        return submit_job(args, environ, PLUGIN_MODULE, (*LOG_DIR_VARS, RUN_ENV))
    return run_here([python, *args], environ, replace=last and not p.run.smoke)


def _smoke_verdict(p: Plan) -> int:
    ckpts = p.paths["CKPTS_DIR"]
    tracker = os.path.join(ckpts, "latest_checkpointed_iteration.txt")
    if not os.path.isdir(ckpts):
        print(
            f"[smoke] both phases finished; {ckpts} is not visible here: check {tracker} on the cluster",
            file=sys.stderr,
        )
        return 0
    try:
        step = Path(tracker).read_text().strip()
    except OSError:
        step = ""
    if step != "4" or not os.path.isdir(os.path.join(ckpts, "global_step_4")):
        print(f"[smoke] FAILED: {tracker} says {step!r}, expected 4 after the resume", file=sys.stderr)
        return 1
    print(f"[smoke] OK: {p.run.method} trained 2 steps, resumed from global_step_2 and trained to step 4 ({ckpts})")
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    argv, environ = list(sys.argv[1:] if argv is None else argv), dict(os.environ if environ is None else environ)
    if {"-h", "--help"} & set(argv):
        print(_usage())
        return 0
    try:
        p = plan(argv, environ)
        p.check_allocation(environ)
        p.check_model_folder()
        mode = submit_mode(environ)
        dry = environ.get("DRY_RUN", "0").lower() in TRUE
        print(p.describe(), file=sys.stderr)
        if dry:
            print(f"[gtpo] DRY_RUN: resolve and check only; the real run would use SUBMIT_MODE={mode}", file=sys.stderr)
        else:
            check_paths(p.paths, cluster_reason(mode, p.nnodes, environ), environ)
            if mode == "job":
                print("[gtpo] paths the cluster will read (nothing but WORKING_DIR is uploaded): "
                      + " ".join(f"{k}={v}" for k, v in p.paths.items()), file=sys.stderr)  # fmt: skip
        os.chdir(REPO_ROOT)  # Hydra's search path file://configs is relative to the working directory
        phases = SMOKE_PHASES if p.run.smoke else ((),)
        for i, phase in enumerate(phases):
            rc = _launch(p, phase, mode, last=i == len(phases) - 1)
            if rc:
                return rc
    except LaunchError as err:
        print(err, file=sys.stderr)
        return LAUNCH_ERROR_EXIT
    if p.run.smoke and not dry:
        return _smoke_verdict(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
