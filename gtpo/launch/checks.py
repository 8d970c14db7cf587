"""Every check that runs before Ray starts, on the composed config and the driver's environment.

:func:`check_config` is the one list the entry point (real runs and ``DRY_RUN=1``) and the preflight run, once and
without side effects; the batch arithmetic it runs is :mod:`gtpo.launch.batch_checks`. :func:`prepare_launch` adds a
real run's checks with side effects. The trainer's own checks are :mod:`gtpo.trainer.guard.startup_checks`. A refusal
is a ``ValueError`` naming the key, its value and what is valid (:class:`ResumeRefused` for the checkpoint a resume
would load).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from gtpo.launch.batch_checks import batch_plan, ulysses_size, verl_mode
from gtpo.methods import ENTROPY, KNOBS, METHODS, entropy_available, fields_needed, knob, recipe_estimator
from gtpo.tools.config import check_multi_turn

__all__ = ["Checked", "ResumeRefused", "check_config", "check_cpu_backend", "check_overlong_shaping",
           "check_evaluation_apart", "check_rollout_caches", "check_world_size_before_launch", "prepare_launch",
           "reshard_evaluation_copy",
           "validate_recipe_config"]  # fmt: skip

# Attention implementations verl's Ulysses all-to-all wraps, and the CPU backend's SDPA that does the same.
CPU_ATTENTION = "gtpo_cpu_sdpa"
ULYSSES_ATTENTION = ("flash_attention_2", "flash_attention_3", CPU_ATTENTION)
# Checkpoint-engine backend -> the modules its verl engine imports, and where they come from.
ENGINE_MODULES = {"nccl": ("cupy",), "nixl": ("cupy", "nixl"), "mooncake": ("mooncake",)}
MODULE_PACKAGES = {"cupy": "cupy-cuda13x", "nixl": "nixl", "mooncake": "mooncake-transfer-engine"}
# The CPU test backend's package; the config key of the environment verl's Ray processes get.
CPU_BACKEND_PACKAGE = "gtpo.cpu"
RUNTIME_ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"
# verl's rollout caches (``skip.<name>``): what one run dumps there, a later one loads with torch.load (code).
ROLLOUT_CACHES = ("rollout", "rollout_tq", "async_rollout")


def _get(config: Any, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default)


def resolved_copy(config: DictConfig) -> DictConfig:
    """A resolved deep copy; an interpolation that fails or a ``???`` left unset (in a section in use) is refused."""
    cfg = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    try:
        OmegaConf.resolve(cfg)
    except Exception as err:  # omegaconf raises several interpolation error types
        raise ValueError(f"configuration does not resolve: {err}") from None
    off = {"reward.reward_model.": not _get(cfg, "reward.reward_model.enable", False),
           "distillation.": not _get(cfg, "distillation.enabled", False)}  # fmt: skip
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not any(k.startswith(p) and o for p, o in off.items()))
    if missing:
        raise ValueError(f"mandatory value(s) left unset ('???'): {', '.join(missing)}")
    OmegaConf.set_struct(cfg, True)
    return cfg


def check_registries(config: DictConfig) -> None:
    """The estimator, the policy loss and the trainer mode are registered in this process."""
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    hint = "is the plugin imported? set VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register"
    named = [("algorithm.adv_estimator", core_algos.ADV_ESTIMATOR_REGISTRY),
             ("actor_rollout_ref.actor.policy_loss.loss_mode", core_algos.POLICY_LOSS_REGISTRY),
             ("trainer.v1.trainer_mode", TRAINER_REGISTRY)]  # fmt: skip
    for key, registry in named:
        value = str(_get(config, key, "vanilla"))
        if value not in registry:
            raise ValueError(f"{key}={value}: not registered ({hint}); known: {sorted(registry)}")


def check_overlong_shaping(config: DictConfig) -> None:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Sec. 3.4) ramps over the last ``len`` tokens of
    ``max_resp_len``, the response length: ``0 < len < max_resp_len``, else every response is punished."""
    kwargs = _get(config, "reward.reward_kwargs") or {}
    buffer = kwargs.get("overlong_buffer_cfg", None) or {}
    if not buffer.get("enable", False):
        return
    buffer_key, max_key = "reward.reward_kwargs.overlong_buffer_cfg.len", "reward.reward_kwargs.max_resp_len"
    buffer_len, max_len = buffer.get("len", None), kwargs.get("max_resp_len", None)
    for key, value in ((buffer_key, buffer_len), (max_key, max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive integer (token count)")
    if buffer_len >= max_len:
        raise ValueError(
            f"{buffer_key}={buffer_len} >= {max_key}={max_len}: the overlong penalty would start at token "
            f"{max_len - buffer_len}, i.e. penalise every response; choose a buffer shorter than the response length "
            "(DAPO: 4096 of 20480; the recipe's presets use 1024 at 4096)"
        )
    if max_len != _get(config, "data.max_response_length"):
        raise ValueError(
            f"{max_key}={max_len} != data.max_response_length={_get(config, 'data.max_response_length')}: the "
            "overlong penalty must end where the rollout truncates (the presets set it to ${data.max_response_length})"
        )


def check_checkpoint_saves(config: DictConfig) -> None:
    """No asynchronous save on an FSDP actor: verl then writes no ``latest_checkpointed_iteration.txt`` (only
    Megatron's checkpoint manager saves asynchronously), so no checkpoint could be resumed."""
    if not (_get(config, "trainer.save_freq", -1) or -1) > 0:
        return
    actor = config.actor_rollout_ref.actor
    strategy = str(actor.get("strategy", "fsdp"))
    if (actor.get("checkpoint", None) or {}).get("async_save", False) and strategy != "megatron":
        raise ValueError(
            f"actor_rollout_ref.actor.checkpoint.async_save=true with actor.strategy={strategy}: verl then writes no "
            "latest_checkpointed_iteration.txt, so no checkpoint could be resumed; set it to false"
        )


def check_sequence_parallel_attention(config: DictConfig) -> None:
    """Ulysses only with an attention that gathers the sequence: under another each rank attends within its shard
    and the run trains on wrong log-probs and entropies without an error."""
    attention = str(_get(config, "actor_rollout_ref.model.override_config.attn_implementation", "flash_attention_2"))
    for role in ("actor", "ref"):
        key, sp = ulysses_size(config, role)
        if sp > 1 and attention not in ULYSSES_ATTENTION:
            raise ValueError(
                f"{key}={sp} with actor_rollout_ref.model.override_config.attn_implementation={attention}: verl's "
                f"Ulysses wraps only {', '.join(ULYSSES_ATTENTION[:2])}; each rank would attend within its own shard "
                f"(use one of {', '.join(ULYSSES_ATTENTION)})"
            )


def check_cpu_attention(config: DictConfig) -> None:
    """The CPU backend's attention only with the CPU backend: on a GPU run ``gtpo_cpu_sdpa`` is a name transformers
    knows only once ``gtpo.cpu`` registered it, which the image does not ship, so every worker would fail building the
    model after the GPUs are allocated."""
    attention = str(_get(config, "actor_rollout_ref.model.override_config.attn_implementation", "flash_attention_2"))
    device = str(_get(config, "trainer.device", "cuda"))
    if attention == CPU_ATTENTION and device != "cpu":
        raise ValueError(
            f"actor_rollout_ref.model.override_config.attn_implementation={attention} with trainer.device={device}: "
            "the CPU test backend's attention exists only with the CPU backend (backend=cpu_tiny, trainer.device=cpu); "
            f"on GPUs use one of {', '.join(ULYSSES_ATTENTION[:2])} (or drop the override)"
        )


def check_grop_and_forking(config: DictConfig, knobs: dict[str, Any]) -> None:
    """GROP only where an estimator applies it, ending where the rollout truncates; the forking loss's
    ``micro_batch`` scope needs the training policy's entropy."""
    estimator, grop, forking = str(config.algorithm.adv_estimator), knobs["grop"], knobs["forking"]
    applying = sorted({row.adv_estimator for row in METHODS.values() if row.applies_grop})
    if grop.enable and estimator not in applying:
        raise ValueError(
            f"algorithm.grop.enable=true with algorithm.adv_estimator={estimator!r}: GROP is applied by the "
            f"{applying} estimators and would be silently ignored"
        )
    response_len = _get(config, "data.max_response_length")
    if grop.enable and grop.hard_mode == "dapo" and grop.dapo_max_length != response_len:
        raise ValueError(
            f"algorithm.grop.dapo_max_length={grop.dapo_max_length} != data.max_response_length={response_len}: "
            "DAPO's punishment of hard groups must end where the rollout truncates"
        )
    training_entropy = _get(config, "actor_rollout_ref.actor.calculate_entropy")
    if forking.enable and forking.scope == "micro_batch" and not training_entropy:
        raise ValueError(
            "algorithm.forking.scope=micro_batch with actor_rollout_ref.actor.calculate_entropy=false: the training "
            "policy's entropy selects the tokens, so the actor must compute it"
        )


def check_recipe_needs(config: DictConfig, forking: Any) -> None:
    """What the run needs from the batch (:func:`gtpo.methods.fields_needed`) only the recipe's trainer modes hand
    over, and the old policy's entropy only verl's old-log-prob pass computes (which bypass mode skips)."""
    from gtpo.trainer.mode_names import TRAINER_MODES

    algorithm, mode = config.algorithm, str(config.trainer.v1.trainer_mode)
    estimator = str(algorithm.adv_estimator)
    row, needs = recipe_estimator(estimator), fields_needed(algorithm)
    who = f"algorithm.adv_estimator={estimator!r}" if row is not None else "algorithm.forking.enable=true"
    if (row is not None or forking.enable) and mode not in TRAINER_MODES:
        raise ValueError(
            f"trainer.v1.trainer_mode={mode!r}: {who} needs one of the recipe's trainer modes "
            f"({', '.join(TRAINER_MODES)}: they hand the estimator its inputs and install the forking loss), e.g. "
            "trainer=sync"
        )
    skipped = [field for field in needs if field == ENTROPY and not entropy_available(algorithm)]
    if skipped:
        if row is None or not set(skipped) & set(row.needs):
            who = "algorithm.forking.scope=batch"
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=true with {who}: it needs the old policy's "
            f"{', '.join(skipped)}, which only verl's old-log-prob pass computes and bypass mode skips; valid: "
            "bypass_mode=false"
        )


def check_verl_mode_constraints(config: DictConfig) -> None:
    """verl's constraints per mode, which it asserts inside its TaskRunner or not at all (the batch's slices and the
    standalone rollout pool: :mod:`gtpo.launch.batch_checks`)."""
    trainer_mode = str(config.trainer.v1.trainer_mode)
    mode = verl_mode(trainer_mode)
    if mode is None:
        return  # an unknown mode is reported by the registry check
    if not _get(config, "actor_rollout_ref.hybrid_engine", True) and mode != "separate_async":
        raise ValueError(
            f"actor_rollout_ref.hybrid_engine=false with trainer.v1.trainer_mode={trainer_mode}: only separate_async "
            "has a standalone rollout pool to serve generation"
        )
    rounds = _get(config, "algorithm.filter_groups.max_num_gen_batches", 0) or 0
    if mode != "sync" and _get(config, "algorithm.filter_groups.enable", False) and rounds > 0:
        raise ValueError(
            f"algorithm.filter_groups.max_num_gen_batches={rounds} with trainer.v1.trainer_mode={trainer_mode}: the "
            "round limit bounds verl's sync replay buffer only (the async buffers refill every evicted group); set "
            "it to 0 (the async presets do)"
        )
    if mode != "separate_async":
        if _get(config, "actor_rollout_ref.rollout.nnodes", 0):
            raise ValueError(
                f"actor_rollout_ref.rollout.nnodes={_get(config, 'actor_rollout_ref.rollout.nnodes')} with "
                f"trainer.v1.trainer_mode={trainer_mode}: a standalone rollout pool exists only under "
                "trainer=separate_async (this mode would leave those nodes idle); add trainer=separate_async or drop it"
            )
        return
    if _get(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", "naive") == "naive":
        raise ValueError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive: separate_async sends weights to another "
            "resource pool; use nccl (or nixl, mooncake, hccl)"
        )
    if _get(config, "reward.reward_model.enable", False) and not _get(
        config, "reward.reward_model.enable_resource_pool"
    ):
        raise ValueError(
            f"reward.reward_model.enable_resource_pool=false with trainer.v1.trainer_mode={trainer_mode}: the "
            "standalone rollout never pauses to free the GPUs a colocated reward model needs"
        )


def check_lora_weight_sync(config: DictConfig) -> None:
    """LoRA only with the naive (in-process) weight sync, the one path on which verl 0.9.1 sends the adapters to vLLM.

    Every other checkpoint engine takes ``update_weights``' first branch: ``get_per_tensor_param()`` with its
    defaults (``base_sync_done=False``) returns ``collect_lora_params``' base weights with every ``lora_`` tensor
    skipped and the PEFT config is dropped (``verl/workers/engine_workers.py`` ``update_weights``,
    ``verl/utils/fsdp_utils.py`` ``collect_lora_params``), so vLLM samples from the frozen base while the actor trains
    the adapter (verl issue #7495). ``trainer=separate_async`` needs such an engine, so it cannot train LoRA."""
    model = config.actor_rollout_ref.model
    rank = int(model.get("lora_rank", 0) or 0) or int((model.get("lora", None) or {}).get("rank", 0) or 0)
    backend = str(_get(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", "naive"))
    if rank <= 0 or backend == "naive":
        return
    mode = str(config.trainer.v1.trainer_mode)
    raise ValueError(
        f"actor_rollout_ref.model.lora_rank={rank} with actor_rollout_ref.rollout.checkpoint_engine.backend={backend} "
        f"(trainer.v1.trainer_mode={mode}): verl 0.9.1 sends LoRA adapters to vLLM only through the naive in-process "
        "sync; its other engines send the base weights without the adapters, so every rollout would come from the "
        "frozen base (verl issue #7495); valid: checkpoint_engine.backend=naive with trainer=sync or "
        "trainer=colocate_async"
    )


def validate_recipe_config(config: DictConfig) -> dict[str, Any]:
    """The recipe's rules; returns the batch plan. Every knob block of :data:`gtpo.methods.KNOBS` is parsed, also
    those of a method not selected: a typo in any knob fails here instead of being silently ignored."""
    from gtpo.launch.value_checks import check_run_values

    check_run_values(config)
    check_registries(config)
    knobs = {block: knob(config.algorithm, block) for block in KNOBS}
    if not config.trainer.get("use_v1", True):
        raise ValueError("trainer.use_v1=False: the gtpo recipe runs on verl's v1 trainer only")
    check_overlong_shaping(config)
    check_checkpoint_saves(config)
    check_sequence_parallel_attention(config)
    check_cpu_attention(config)
    check_grop_and_forking(config, knobs)
    check_recipe_needs(config, knobs["forking"])
    check_verl_mode_constraints(config)
    check_multi_turn(config)  # the tool config, the parser and the turn limits, before an agent-loop worker reads them
    check_lora_weight_sync(config)
    return batch_plan(config)


def check_cpu_backend(config: Any, environ: Mapping[str, str] | None = None) -> None:
    """No CPU test backend (``VERL_PLATFORM=cpu``, a ``gtpo.cpu`` module to load, as :func:`gtpo.cpu.env` sets them)
    unless ``trainer.device=cpu``: inherited from a test shell it would run the GPU workers on gloo, very slowly."""
    device = str(_get(config, "trainer.device", "cuda"))
    if device == "cpu":
        return
    sources = {"the environment": os.environ if environ is None else environ,
               RUNTIME_ENV_VARS_KEY: _get(config, RUNTIME_ENV_VARS_KEY) or {}}  # fmt: skip
    found = []
    for where, env in sources.items():
        platform = str(env.get("VERL_PLATFORM", "") or "")
        if platform.strip().lower() == "cpu":
            found.append(f"VERL_PLATFORM={platform} ({where})")
        modules = [m.strip() for m in str(env.get("VERL_USE_EXTERNAL_MODULES", "") or "").split(",")]
        cpu = [m for m in modules if m == CPU_BACKEND_PACKAGE or m.startswith(CPU_BACKEND_PACKAGE + ".")]
        if cpu:
            found.append(f"VERL_USE_EXTERNAL_MODULES with {','.join(cpu)} ({where})")
    if found:
        raise ValueError(
            f"trainer.device={device} but {'; '.join(found)}: the CPU test backend (gtpo.cpu.env()) would run verl's "
            "workers on its cpu platform with gloo-only process groups; unset these for a GPU run, or run the CPU "
            "backend with backend=cpu_tiny (trainer.device=cpu)"
        )


def check_run_folder(config: DictConfig, environ: Mapping[str, str]) -> None:
    """The checkpoint folder this run resumes from and prunes holds no other run: its record
    (:data:`gtpo.launch.runs.RUN_RECORD`) names the method, model, adapter and algorithm overrides of this one."""
    from gtpo.launch.runs import RUN_RECORD, described, recorded_run, run_identity

    run = run_identity(environ)
    if run is None:
        return
    folders = [("trainer.default_local_dir", _get(config, "trainer.default_local_dir"))]
    if str(_get(config, "trainer.resume_mode")) == "resume_path" and _get(config, "trainer.resume_from_path"):
        folders.append(("trainer.resume_from_path", os.path.dirname(os.path.abspath(config.trainer.resume_from_path))))
    same = ("method", "model", "adapter", "changes")
    for key, folder in folders:
        recorded = recorded_run(str(folder)) if folder else None
        if recorded is not None and [recorded.get(k) for k in same] != [run.get(k) for k in same]:
            raise ValueError(
                f"{key}={folder} holds the run {recorded.get('name')} ({described(recorded)}), not "
                f"{run.get('name')} ({described(run)}): this run would resume and prune its checkpoints; choose "
                f"another CKPTS_DIR or EXP_NAME (or remove {os.path.join(str(folder), RUN_RECORD)} to adopt the folder)"
            )


def _evaluated_checkpoint(config: Any) -> str | None:
    """The checkpoint a validation-only run (``trainer.val_only``, scripts/eval_checkpoint.sh) evaluates, or None."""
    trainer = config.trainer
    if not trainer.get("val_only", False) or str(trainer.get("resume_mode", "")) != "resume_path":
        return None
    path = trainer.get("resume_from_path", None)
    return os.path.abspath(str(path)) if path else None


def check_evaluation_apart(config: DictConfig, environ: Mapping[str, str]) -> None:
    """An evaluation (``trainer.val_only`` of ``trainer.resume_from_path``) writes nothing of the run it evaluates,
    which may still be training: no folder of it inside the run's folder (the run's retention prunes
    ``global_step_<N>``, its resume reads the rest) and not the run's experiment name (the metric log, TensorBoard and
    W&B run of that name are the run's: verl opens the file log with ``"wb"``)."""
    checkpoint = _evaluated_checkpoint(config)
    if checkpoint is None:
        return
    from gtpo.launch.runs import recorded_run
    from gtpo.trainer.observe.metric_history import uses_file_logger

    run_dir = os.path.dirname(checkpoint)
    trainer, env = config.trainer, {**environ, **(_get(config, RUNTIME_ENV_VARS_KEY) or {})}
    written = {"trainer.default_local_dir": trainer.get("default_local_dir", None),
               "trainer.validation_data_dir": trainer.get("validation_data_dir", None)}  # fmt: skip
    if uses_file_logger(trainer.get("logger", None)):
        root = env.get("VERL_FILE_LOGGER_ROOT") or "."
        written["its metric log"] = env.get("VERL_FILE_LOGGER_PATH") or os.path.join(
            os.path.expanduser(str(root)), str(trainer.project_name), f"{trainer.experiment_name}.jsonl"
        )
    for name in ("TENSORBOARD_DIR", "WANDB_DIR"):
        written[name] = env.get(name)
    for key, path in written.items():
        if not path:
            continue
        path = os.path.abspath(str(path))
        if path == run_dir or path.startswith(run_dir + os.sep):
            raise ValueError(
                f"{key}={path}: trainer.val_only=true evaluates {checkpoint} but would write inside its run's folder "
                f"{run_dir}, which that run prunes and may still be writing; give the evaluation a folder of its own "
                "(scripts/eval_checkpoint.sh: EVAL_DIR outside the run's folder)"
            )
    recorded = recorded_run(run_dir)
    if recorded is not None and recorded.get("name") == str(trainer.experiment_name):
        raise ValueError(
            f"trainer.experiment_name={trainer.experiment_name}: the name of the run that saved {checkpoint}; its "
            "metric log, TensorBoard folder and W&B run are that run's, which may still be training; name the "
            "evaluation (EXP_NAME; scripts/eval_checkpoint.sh names it <run>-eval-step<N>)"
        )


def reshard_evaluation_copy(config: DictConfig, layout: Any) -> str | None:
    """An evaluation of a checkpoint saved at another world size loads a resharded copy in its own folder
    (``<trainer.default_local_dir>/resharded/global_step_<N>``, kept for the next evaluation at this size), never the
    run's checkpoint resharded in place; ``config.trainer.resume_from_path`` is pointed at the copy. Returns the copy,
    or None when the checkpoint loads as it is.

    Raises:
        ResumeRefused: what cannot be resharded, or is too large to reshard inside the job, named.
    """
    from gtpo.trainer.resume.checkpoint_world_size import check_in_job_reshard_size, reshard_problems, run_world_size
    from gtpo.trainer.resume.checkpoints import ROLE_DIRS, role_world_size
    from gtpo.trainer.resume.reshard import ReshardRefused, reshard_checkpoint

    checkpoint = _evaluated_checkpoint(config)
    if checkpoint is None or not os.path.isdir(checkpoint):
        return None
    world_size = run_world_size(config.trainer)
    try:
        sizes = [role_world_size(os.path.join(checkpoint, role)) for role in ROLE_DIRS]
    except ValueError as err:
        raise ResumeRefused(f"cannot evaluate {checkpoint}: {err}") from None
    if all(size in (None, world_size) for size in sizes):
        return None
    _refuse_unless_private(checkpoint, "trainer.resume_from_path", inside=True)
    problems = reshard_problems(checkpoint, config, layout)
    if problems:
        raise ResumeRefused(f"cannot reshard {checkpoint} to world size {world_size}: {'; '.join(problems)}")
    try:
        check_in_job_reshard_size(checkpoint, config)
    except RuntimeError as err:
        raise ResumeRefused(str(err)) from None
    own_folder = os.path.abspath(str(config.trainer.default_local_dir))
    copy = os.path.join(own_folder, "resharded", os.path.basename(checkpoint))
    actor = os.path.join(copy, "actor")
    if not (os.path.isdir(actor) and role_world_size(actor) == world_size):
        shutil.rmtree(copy, ignore_errors=True)  # an earlier evaluation's copy at another size: this one's own
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        try:
            reshard_checkpoint(checkpoint, world_size, out=copy)
        except ReshardRefused as err:
            raise ResumeRefused(f"cannot reshard {checkpoint} to world size {world_size}: {err}") from None
        print(f"gtpo: evaluating {checkpoint} through a copy resharded to world size {world_size}: {copy}")
    with open_dict(config):
        config.trainer.resume_from_path = copy
    return copy


def check_model_folder(config: DictConfig, environ: Mapping[str, str]) -> None:
    """Under a launcher (its run in ``environ``), the model folder's ``config.json``, when readable here, is the model
    the run's model preset is sized for: its budgets, offload and vLLM share are another model's otherwise."""
    from gtpo.launch.runs import read_preset, run_identity
    from gtpo.launch.state_memory import model_mismatch

    run = run_identity(environ)
    if run is None or str(_get(config, "trainer.device")) == "cpu":
        return  # no launcher run, or the CPU test backend, which runs a preset's code paths on its tiny model
    hub_id = (read_preset("model", run["model"]).get("actor_rollout_ref") or {}).get("model", {}).get("path", "")
    expected, path = os.path.basename(str(hub_id)), str(_get(config, "actor_rollout_ref.model.path"))
    mismatch = model_mismatch(expected, path)
    if mismatch:
        raise ValueError(
            f"actor_rollout_ref.model.path={path}: {mismatch}, but model={run['model']} is sized for {expected}; "
            f"point MODEL_PATH at a {expected} folder, or run that model's preset"
        )


def check_gpu_memory(config: DictConfig) -> None:
    """Each pass's peak per GPU (:mod:`gtpo.launch.gpu_peak`, an estimate) fits every GPU the run is sized for
    (``algorithm.hardware.gpu_memory_gib``), and vLLM's share holds at least one full sequence: refused before Ray
    otherwise, naming the pass, its terms and the card."""
    from gtpo.launch.gpu_peak import peak_problems

    problems = peak_problems(config)
    if problems:
        raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Checked:
    """What :func:`check_config` found: the resolved copy, the batch plan and what verl's ``validate_config`` said."""

    config: DictConfig
    plan: dict[str, Any]
    use_reference_policy: bool
    use_critic: bool
    verl_output: str


def check_config(config: DictConfig, environ: Mapping[str, str] | None = None) -> Checked:
    """Every check of a composed config, once, without side effects (``config`` is left untouched)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    environ = os.environ if environ is None else environ
    check_cpu_backend(config, environ)
    cfg = resolved_copy(config)
    plan = validate_recipe_config(cfg)
    check_model_folder(cfg, environ)
    check_gpu_memory(cfg)
    check_run_folder(cfg, environ)
    check_evaluation_apart(cfg, environ)
    use_ref, use_critic, out = bool(need_reference_policy(cfg)), bool(need_critic(cfg)), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            validate_config(config=cfg, use_reference_policy=use_ref, use_critic=use_critic)
    except Exception as err:  # asserts, dataclass errors wrapped by hydra's instantiation
        kind = "" if isinstance(err, AssertionError | ValueError) else f"{type(err).__name__}: "
        why = " ".join(f"{kind}{err}".split())
        raise ValueError(f"verl.utils.config.validate_config rejected the configuration: {why}") from None
    return Checked(cfg, plan, use_ref, use_critic, out.getvalue().strip())


def _package_spec(module: str) -> str:
    """``cupy-cuda13x==14.0.1`` as verl's wheel pins it, else the package's name."""
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
    """The checkpoint engine's transport imports here (verl's workers would only say "not registered" at init)."""
    backend = str(_get(config, "actor_rollout_ref.rollout.checkpoint_engine.backend", "naive"))
    for module in ENGINE_MODULES.get(backend, ()):
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(
                f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}: verl's {backend} checkpoint engine "
                f"imports {module}, which does not import here ({err}); install {_package_spec(module)} (the recipe "
                "image, docker/Dockerfile, has it) or choose another backend"
            ) from None


class ResumeRefused(ValueError):
    """The checkpoint a resume would load is refused before Ray starts: one line naming it and why."""


def _refuse_unless_private(folder: str, what: str, inside: bool) -> None:
    """:func:`gtpo.trainer.resume.loads.refuse_unless_private`, a refusal as :class:`ResumeRefused`: verl loads
    checkpoints with ``torch.load``, which runs code."""
    from gtpo.trainer.resume.loads import refuse_unless_private

    try:
        refuse_unless_private(folder, what, inside)
    except RuntimeError as err:
        raise ResumeRefused(str(err)) from None


def check_world_size_before_launch(config: Any, layout: Any) -> str | None:
    """The checkpoint a resume would load (the named one, or the tracker's when complete, else the newest complete
    one), refused when others could plant files in it, resharded to this world size or refused
    (:func:`gtpo.trainer.resume.checkpoint_world_size.match_resume_world_size`); the trainer checks again right before
    its loads, and each worker before its own. Returns the folder checked, or None.

    Raises:
        ResumeRefused: one line naming the folder and why (a ``ValueError``: the entry point prints it, exit 2).
    """
    from gtpo.trainer.resume.checkpoint_world_size import match_resume_world_size
    from gtpo.trainer.resume.checkpoints import incomplete_reasons, newest_complete, read_tracker
    from gtpo.trainer.resume.reshard import finish_interrupted_reshards

    trainer = config.trainer
    mode = str(trainer.get("resume_mode", "disable"))
    if mode == "resume_path" and trainer.get("resume_from_path"):
        folder = os.path.abspath(str(trainer.resume_from_path))
    elif mode == "auto" and trainer.get("default_local_dir"):
        root = os.path.abspath(str(trainer.default_local_dir))
        if os.path.lexists(root):  # before reading anything in it
            _refuse_unless_private(root, "trainer.default_local_dir", inside=False)
            finish_interrupted_reshards(root)
        step, _ = read_tracker(root)
        folder = os.path.join(root, f"global_step_{step}") if step is not None else None
        if folder is None or incomplete_reasons(folder, step, layout):
            folder = (newest_complete(root, layout) or (None, None))[1]
    else:
        return None
    if folder is None or not os.path.lexists(folder):
        return None
    _refuse_unless_private(folder, "trainer.resume_from_path" if mode == "resume_path" else "checkpoint", inside=True)
    try:
        match_resume_world_size(folder, config, layout)
    except RuntimeError as err:  # the recipe's refusals of another world size, named
        raise ResumeRefused(str(err)) from None
    return folder


def check_rollout_caches(config: Any) -> None:
    """Refuse the ``skip.<name>.dump_dir`` of an enabled rollout cache (``ValueError``, one line naming the key)
    unless nobody else could have written into it or swap it (:func:`gtpo.private_files.check_private_tree`; a
    folder not made yet: the folders above it): verl's TaskRunner loads the batches it finds there with
    ``torch.load(weights_only=False)`` (``verl/utils/skip/rollout_skip.py``), which runs whatever a planted file
    holds."""
    from gtpo.private_files import check_private_tree, check_unswappable_parents

    for name in ROLLOUT_CACHES:
        if not _get(config, f"skip.{name}.enable", False):
            continue
        key = f"skip.{name}.dump_dir"
        folder = os.path.abspath(os.path.expanduser(str(_get(config, key))))
        try:
            if os.path.lexists(folder):
                check_private_tree(folder, key, kind="rollout cache")
            else:
                check_unswappable_parents(folder, key)
        except OSError as err:
            raise ValueError(str(err)) from None


def prepare_launch(config: DictConfig, checked: Checked, environ: Mapping[str, str] | None = None) -> None:
    """A real run's checks that read this machine, after :func:`check_config`: the checkpoint engine, the data
    (:func:`gtpo.launch.data_checks.check_data`), the rollout caches verl would load (:func:`check_rollout_caches`),
    the checkpoint a resume would load, then this run's record in the checkpoint folder when it will save there."""
    from gtpo.launch.data_checks import check_data
    from gtpo.launch.runs import run_identity, write_record
    from gtpo.trainer.resume.checkpoints import layout_of

    environ = os.environ if environ is None else environ
    check_checkpoint_engine(checked.config)
    check_data(checked.config)
    check_rollout_caches(checked.config)
    async_mode = verl_mode(str(config.trainer.v1.trainer_mode)) != "sync"
    layout = layout_of(config, checked.use_critic, async_mode)
    reshard_evaluation_copy(config, layout)
    check_world_size_before_launch(config, layout)
    run, trainer = run_identity(environ), checked.config.trainer
    if run is not None and not trainer.get("val_only", False) and (trainer.get("save_freq", -1) or -1) > 0:
        write_record(str(trainer.default_local_dir), run)
