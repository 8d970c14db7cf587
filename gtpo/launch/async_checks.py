"""Config-time checks of the trainer mode: which modes can feed the recipe, and verl's own constraints per mode.

Run by :func:`gtpo.launch.validation.validate_recipe_config` (the entry point, before Ray starts) and by the
dry run. verl 0.9.1 checks most of these only inside ``PPOTrainerSeparateAsync.__init__`` (asserts in the
TaskRunner, after Ray and the workers' resource pools are up) or not at all; here each failure is a
``ValueError`` naming the key and its value.

What the recipe needs (docs: README, "Asynchronous training"):

* the recipe's estimators and the forking loss run only under the recipe's modes ``gtpo_sync``,
  ``gtpo_colocate_async``, ``gtpo_separate_async`` (verl's own ``sync`` / ``*_async`` trainers drop the entropy
  and the token ids);
* they use the entropy recomputed in verl's old-log-prob pass, which rollout correction's ``bypass_mode`` skips;
* DAPO's ``max_num_gen_batches`` round limit bounds verl's *sync* replay buffer only; the async buffers refill
  every evicted group as it is evicted, and the limit would be silently ignored there.

verl's constraints per mode (``verl/trainer/ppo/v1/trainer_{base,separate_async}.py``):

* every mode: ``data.train_batch_size`` divisible by the mode's ``parameter_sync_step``;
  ``actor_rollout_ref.hybrid_engine=false`` only under ``separate_async``;
* ``separate_async``: ``train_batch_size == parameter_sync_step * ppo_mini_batch_size``, a standalone rollout pool
  (``actor_rollout_ref.rollout.nnodes`` and ``n_gpus_per_node`` > 0), a checkpoint engine other than ``naive``,
  and a reward model, if any, in its own resource pool;
* the other modes never build the standalone pool, so a ``rollout.nnodes > 0`` there would book nodes for nothing.

At the start of a real run and in the preflight (not in the laptop dry run), :func:`check_checkpoint_engine`
imports the transport module of the configured checkpoint engine: verl's NCCL engine imports ``cupy`` and, when
that fails, the workers report only "Checkpoint engine nccl not registered" at init, after Ray and the GPUs are up.

:func:`startup_notes` are the decided-but-surprising cases, logged at startup and printed by the dry run: batch-scope
statistics under ``parameter_sync_step > 1`` (verl's step computes the advantages of each slice separately).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re

from omegaconf import DictConfig, OmegaConf

__all__ = ["check_checkpoint_engine", "check_trainer_mode", "startup_notes", "verl_mode"]

# verl's own registered modes, for the checks that apply whichever class runs them.
VERL_MODES = ("sync", "colocate_async", "separate_async")


def verl_mode(trainer_mode: str) -> str | None:
    """The verl mode behind ``trainer.v1.trainer_mode`` (``gtpo_colocate_async`` -> ``colocate_async``), or None."""
    from gtpo.trainer.mode_names import TRAINER_MODES

    if trainer_mode in TRAINER_MODES:
        return TRAINER_MODES[trainer_mode]
    return trainer_mode if trainer_mode in VERL_MODES else None


def _value(config: DictConfig, key: str, default: object = None) -> object:
    """``key`` of ``config``; a ``???`` left unset raises a ValueError naming it."""
    if _is_missing(config, key):
        raise ValueError(f"{key}=???: must be set for trainer.v1.trainer_mode={config.trainer.v1.trainer_mode}")
    return OmegaConf.select(config, key, default=default)


def _is_missing(config: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(config, parent, default=None) if parent else config
    return isinstance(node, DictConfig) and leaf in node and OmegaConf.is_missing(node, leaf)


def check_recipe_needs(config: DictConfig, estimator: str, forking_enable: bool, forking_scope: str) -> None:
    """The recipe's estimators and the forking loss need a recipe mode and the old-log-prob pass."""
    from gtpo.methods import recipe_estimator
    from gtpo.trainer.mode_names import TRAINER_MODES

    mode = str(config.trainer.v1.trainer_mode)
    modes = ", ".join(TRAINER_MODES)
    if recipe_estimator(estimator) is not None and mode not in TRAINER_MODES:
        raise ValueError(
            f"trainer.v1.trainer_mode={mode!r}: algorithm.adv_estimator={estimator!r} needs one of the recipe's "
            f"trainer modes ({modes}; the ones that hand it the old-policy entropy), e.g. trainer=colocate_async"
        )
    if forking_enable and mode not in TRAINER_MODES:
        raise ValueError(
            f"algorithm.forking.enable=true with trainer.v1.trainer_mode={mode!r}: the forking-token loss is "
            f"installed by the recipe's trainer modes ({modes})"
        )
    rollout_corr = config.algorithm.get("rollout_correction", None)
    if rollout_corr is None or not rollout_corr.get("bypass_mode", False):
        return
    why = "bypass mode skips the old-log-prob pass, which is where verl computes the per-token entropy"
    if recipe_estimator(estimator) is not None:
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true with algorithm.adv_estimator={estimator!r}: {why} this "
            "estimator needs (use decoupled mode: bypass_mode=false)"
        )
    if forking_enable and forking_scope == "batch":
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true with algorithm.forking.scope=batch: {why} whose batch "
            "quantile selects the forking tokens (use scope=micro_batch or bypass_mode=false)"
        )


def check_verl_mode_constraints(config: DictConfig) -> None:
    """verl's own constraints for the selected mode (see the module docstring)."""
    trainer_mode = str(config.trainer.v1.trainer_mode)
    mode = verl_mode(trainer_mode)
    if mode is None:
        return  # an unknown mode is reported by the registry check
    hybrid_engine = bool(_value(config, "actor_rollout_ref.hybrid_engine", True))
    if not hybrid_engine and mode != "separate_async":
        raise ValueError(
            f"actor_rollout_ref.hybrid_engine=false with trainer.v1.trainer_mode={trainer_mode}: only separate_async "
            "has a standalone rollout pool to serve generation"
        )
    train_batch_size = _value(config, "data.train_batch_size")
    sync_key = f"trainer.v1.{mode}.parameter_sync_step"
    parameter_sync_step = _value(config, sync_key, 1)
    if isinstance(parameter_sync_step, bool) or not isinstance(parameter_sync_step, int) or parameter_sync_step < 1:
        raise ValueError(f"{sync_key}={parameter_sync_step!r}: must be a positive integer")
    if train_batch_size % parameter_sync_step:
        raise ValueError(
            f"data.train_batch_size={train_batch_size} is not divisible by {sync_key}={parameter_sync_step}"
        )
    filter_groups = config.algorithm.get("filter_groups", None) or {}
    rounds = filter_groups.get("max_num_gen_batches", 0) or 0
    if mode != "sync" and filter_groups.get("enable", False) and rounds > 0:
        raise ValueError(
            f"algorithm.filter_groups.max_num_gen_batches={rounds} with trainer.v1.trainer_mode={trainer_mode}: the "
            "round limit bounds verl's sync replay buffer only (the async buffers refill every evicted group); set "
            "it to 0 (the async presets do)"
        )
    if mode != "separate_async":
        rollout_nodes = _value(config, "actor_rollout_ref.rollout.nnodes", 0) or 0
        if rollout_nodes:
            raise ValueError(
                f"actor_rollout_ref.rollout.nnodes={rollout_nodes} with trainer.v1.trainer_mode={trainer_mode}: a "
                "standalone rollout pool exists only under trainer=separate_async (this mode would leave those nodes "
                "idle); add trainer=separate_async or drop the override"
            )
        return
    mini_batch = _value(config, "actor_rollout_ref.actor.ppo_mini_batch_size")
    if train_batch_size != parameter_sync_step * mini_batch:
        raise ValueError(
            f"data.train_batch_size={train_batch_size} != {sync_key}={parameter_sync_step} x "
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}: separate_async syncs weights after "
            f"parameter_sync_step mini-batches of one step (e.g. {sync_key}={max(1, train_batch_size // mini_batch)})"
        )
    for key in ("actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node"):
        value = _value(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{key}={value!r}: separate_async needs a standalone rollout pool of its own GPUs (a positive "
                "count, on top of trainer.nnodes x trainer.n_gpus_per_node: on nodes of its own, or beside the "
                f"trainer's on shared nodes where both fit), e.g. {key}=1"
            )
    backend = _value(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", "naive")
    if backend == "naive":
        raise ValueError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: separate_async sends weights to another "
            "resource pool; use nccl (or nixl, mooncake, hccl)"
        )
    if _value(config, "reward.reward_model.enable", False) and not _value(
        config, "reward.reward_model.enable_resource_pool", False
    ):
        raise ValueError(
            "reward.reward_model.enable_resource_pool=false with trainer.v1.trainer_mode="
            f"{trainer_mode}: the standalone rollout never pauses to free the GPUs a colocated reward model needs"
        )


def check_trainer_mode(config: DictConfig) -> None:
    """Every trainer-mode check above, on a composed (resolved or not) config."""
    from gtpo.methods import knob

    forking = knob(config.algorithm, "forking")
    check_recipe_needs(config, str(config.algorithm.adv_estimator), bool(forking.enable), str(forking.scope))
    check_verl_mode_constraints(config)


# Checkpoint-engine backend -> the modules its verl engine imports (verl/checkpoint_engine/<backend>_*.py).
ENGINE_MODULES = {"nccl": ("cupy",), "nixl": ("cupy", "nixl"), "mooncake": ("mooncake",)}
# Where each module comes from; cupy's pin is read from verl's own metadata when it is there.
MODULE_PACKAGES = {"cupy": "cupy-cuda13x", "nixl": "nixl", "mooncake": "mooncake-transfer-engine"}


def _package_spec(module: str) -> str:
    """``cupy-cuda13x==14.0.1`` as verl's wheel pins it (its cupy-cu130 extra, pulled in by fsdp), else the name."""
    name = MODULE_PACKAGES.get(module, module)
    try:
        requirements = importlib.metadata.requires("verl") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        found = re.match(rf"{re.escape(name)}\s*(==\s*[\w.]+)", requirement)
        if found:
            return name + found.group(1).replace(" ", "")
    return name


def check_checkpoint_engine(config: DictConfig) -> None:
    """Refuse a checkpoint-engine backend whose transport module does not import in this environment.

    Raises:
        ValueError: naming the backend, the module, the import error and the package to install.
    """
    backend = str(OmegaConf.select(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", default="naive"))
    for module in ENGINE_MODULES.get(backend, ()):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}: verl's {backend} checkpoint engine "
                f"imports {module}, which does not import here ({err}); install {_package_spec(module)} (the recipe "
                "image, docker/Dockerfile, has it) or choose another backend"
            ) from None


def startup_notes(config: DictConfig) -> list[str]:
    """Warnings for a configuration that runs but differs from what its keys suggest (see the module docstring)."""
    from gtpo.methods import knob

    trainer_mode = str(config.trainer.v1.trainer_mode)
    mode = verl_mode(trainer_mode)
    if mode is None:
        return []
    sync_step = OmegaConf.select(config, f"trainer.v1.{mode}.parameter_sync_step", default=1) or 1
    if sync_step <= 1:
        return []
    estimator = str(config.algorithm.adv_estimator)
    scopes = []
    if estimator == "gtpo":
        scopes += [
            f"algorithm.gtpo.{key}=batch"
            for key in ("norm_scope", "weight_scope")
            if OmegaConf.select(config, f"algorithm.gtpo.{key}", default=None) == "batch"
        ]
    forking = knob(config.algorithm, "forking")
    if forking.enable and forking.scope == "batch":
        scopes.append("algorithm.forking.scope=batch")
    if not scopes:
        return []
    prompts = int(config.data.train_batch_size)
    n = int(config.actor_rollout_ref.rollout.n)
    per_slice = prompts // sync_step
    logged = f"{estimator}/estimator_rows" if estimator == "gtpo" else "forking/batch_scope_rows"
    return [
        f"{', '.join(scopes)} with trainer.v1.{mode}.parameter_sync_step={sync_step}: verl's step computes the "
        f"advantages of each of its {sync_step} slices on its own, so these statistics cover one slice of "
        f"{per_slice} prompts ({per_slice * n} responses), not the step's {prompts} ({prompts * n}) as under "
        f"trainer=sync (logged per call as {logged}). The whole-batch scope needs parameter_sync_step=1, i.e. one "
        "update of the whole batch per step under separate_async; group scopes (norm_scope=group, weight_scope="
        "group, forking scope=micro_batch) do not depend on it."
    ]
