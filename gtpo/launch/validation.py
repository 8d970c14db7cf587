"""Config-time checks of the recipe's settings, run by the entry point before Ray starts or a GPU is touched.

Each check raises ``ValueError`` naming the key and the bad value.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from gtpo.methods import KNOBS, METHODS, knob


def load_all_knobs(algorithm: DictConfig) -> dict[str, object]:
    """Parse every knob block of the recipe (:data:`gtpo.methods.KNOBS`), even those of an estimator not selected,
    so a typo in any knob fails at startup instead of being silently ignored (errors name the key)."""
    return {block: knob(algorithm, block) for block in KNOBS}


def check_overlong_window(buffer_len: object, max_len: object, buffer_key: str, max_key: str) -> None:
    """A soft overlong punishment (DAPO, arXiv 2503.14476, Sec. 3.4) needs ``0 < buffer_len < max_len``.

    The penalty is 0 up to ``max_len - buffer_len`` tokens and ramps to -1 at ``max_len``; a buffer as long as the
    response (``max_response_length=4096`` with DAPO's 4,096 buffer) penalises every response from its first token.

    Raises:
        ValueError: naming both keys and their values.
    """
    for key, value in ((buffer_key, buffer_len), (max_key, max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r}: must be a positive integer (token count)")
    if buffer_len >= max_len:
        raise ValueError(
            f"{buffer_key}={buffer_len} >= {max_key}={max_len}: the overlong penalty would start at token "
            f"{max_len - buffer_len}, i.e. penalise every response; choose a buffer shorter than the response length "
            "(DAPO: 4096 of 20480; the recipe's presets use 1024 at 4096)"
        )


def check_overlong_shaping(config: DictConfig) -> None:
    """verl's DAPO reward manager: the overlong buffer is shorter than ``max_resp_len`` = the response length."""
    reward_kwargs = OmegaConf.select(config, "reward.reward_kwargs", default=None) or {}
    buffer = reward_kwargs.get("overlong_buffer_cfg", None) or {}
    if not buffer.get("enable", False):
        return
    response_len = OmegaConf.select(config, "data.max_response_length")
    max_resp_len = reward_kwargs.get("max_resp_len", None)
    check_overlong_window(
        buffer.get("len", None),
        max_resp_len,
        "reward.reward_kwargs.overlong_buffer_cfg.len",
        "reward.reward_kwargs.max_resp_len",
    )
    if max_resp_len != response_len:
        raise ValueError(
            f"reward.reward_kwargs.max_resp_len={max_resp_len} != data.max_response_length={response_len}: the "
            "overlong penalty must end where the rollout truncates (the presets set it to ${data.max_response_length})"
        )


def check_checkpoint_saves(config: DictConfig) -> None:
    """Every saved checkpoint can be resumed from: no asynchronous save on an FSDP actor.

    With ``actor_rollout_ref.actor.checkpoint.async_save=true`` verl 0.9.1's v1 ``_save_checkpoint`` skips the tracker
    ``latest_checkpointed_iteration.txt`` and leaves it to the asynchronous writer, which only Megatron's checkpoint
    manager has; on FSDP no checkpoint would ever be tracked, and each restart would begin from scratch.
    """
    if not (OmegaConf.select(config, "trainer.save_freq", default=-1) or -1) > 0:
        return
    actor = config.actor_rollout_ref.actor
    strategy = str(actor.get("strategy", "fsdp"))
    if (actor.get("checkpoint", None) or {}).get("async_save", False) and strategy != "megatron":
        raise ValueError(
            f"actor_rollout_ref.actor.checkpoint.async_save=true with actor.strategy={strategy}: verl then writes no "
            "latest_checkpointed_iteration.txt (only Megatron saves asynchronously), so no checkpoint could be "
            "resumed; set it to false"
        )


# Attention implementations verl's Ulysses all-to-all wraps (``apply_monkey_patch`` replaces transformers'
# ``_flash_attention_forward``), and the CPU backend's SDPA that does the same (gtpo/cpu/ulysses_attention.py).
ULYSSES_ATTENTION = ("flash_attention_2", "flash_attention_3", "gtpo_cpu_sdpa")


def check_sequence_parallel_attention(config: DictConfig) -> None:
    """Ulysses only with an attention that gathers the sequence: under any other each rank attends within its own
    shard, and the run trains on wrong log-probs and entropies without an error (verl's default is
    ``flash_attention_2``)."""
    from gtpo.launch.batch_checks import ulysses_size

    model = config.actor_rollout_ref.model
    attention = str((model.get("override_config", None) or {}).get("attn_implementation", "flash_attention_2"))
    for role in ("actor", "ref"):
        key, sp = ulysses_size(config, role)
        if sp > 1 and attention not in ULYSSES_ATTENTION:
            raise ValueError(
                f"{key}={sp} with "
                f"actor_rollout_ref.model.override_config.attn_implementation={attention}: verl's Ulysses wraps only "
                f"{', '.join(ULYSSES_ATTENTION[:2])}; with {attention} each rank would attend within its own shard of "
                f"the sequence and train on wrong log-probs (use one of {', '.join(ULYSSES_ATTENTION)})"
            )


def validate_recipe_config(config: DictConfig) -> None:
    """Validate the recipe-specific parts of a composed trainer config."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    from gtpo.launch.async_checks import check_trainer_mode
    from gtpo.launch.batch_checks import check_micro_batches

    algorithm = config.algorithm
    estimator = str(algorithm.adv_estimator)
    try:
        get_adv_estimator_fn(estimator)
    except ValueError as err:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} is not registered: {err}") from None
    loss_mode = config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla")
    try:
        get_policy_loss_fn(loss_mode)
    except ValueError as err:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r}: {err}") from None

    knobs = load_all_knobs(algorithm)
    check_overlong_shaping(config)
    check_checkpoint_saves(config)
    check_micro_batches(config)
    check_sequence_parallel_attention(config)
    grop_on = bool(knobs["grop"].enable)
    if not config.trainer.get("use_v1", True):
        raise ValueError("trainer.use_v1=False: the gtpo recipe runs on verl's v1 trainer only")
    applying_grop = sorted({row.adv_estimator for row in METHODS.values() if row.applies_grop})
    if grop_on and estimator not in applying_grop:
        raise ValueError(
            f"algorithm.grop.enable=true with algorithm.adv_estimator={estimator!r}: GROP is applied by the "
            f"{applying_grop} estimators and would be silently ignored"
        )
    grop = knobs["grop"]
    response_len = OmegaConf.select(config, "data.max_response_length")
    if grop_on and grop.hard_mode == "dapo" and grop.dapo_max_length != response_len:
        raise ValueError(
            f"algorithm.grop.dapo_max_length={grop.dapo_max_length} != data.max_response_length={response_len}: "
            "DAPO's punishment of hard groups must end where the rollout truncates"
        )
    forking = knobs["forking"]
    actor = config.actor_rollout_ref.actor
    if forking.enable and forking.scope == "micro_batch" and not actor.get("calculate_entropy", False):
        raise ValueError(
            "algorithm.forking.scope=micro_batch with actor_rollout_ref.actor.calculate_entropy=false: the "
            "training policy's entropy selects the tokens, so the actor must compute it"
        )
    check_trainer_mode(config)  # recipe modes, bypass mode, verl's per-mode constraints
