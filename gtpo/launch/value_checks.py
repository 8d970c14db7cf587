"""Numbers a run cannot train with, refused before Ray starts in one line naming the key and the valid range.

verl accepts them and fails late or not at all: a negative ``trainer.total_training_steps`` starts every worker and
exits 0 having trained nothing, ``total_epochs=0`` trains nothing either, a NaN learning rate fails in the workers,
a NaN clip ratio trains with a NaN loss, and a huge ``rollout.n`` or token budget is found out by the OOM killer.
:func:`check_run_values` (called first by :func:`gtpo.launch.checks.validate_recipe_config`, so also by the dry run
and the preflight) refuses each:

* ``trainer.total_training_steps``: null (the epochs decide) or an integer >= 1; ``trainer.total_epochs`` an
  integer >= 1;
* learning rates (``optim.lr`` of the actor and the critic): a finite number > 0;
* clip ratios (``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high`` of the actor and the critic's
  ``cliprange_value``): finite, in (0, 1]; the dual-clip bound ``clip_ratio_c``: finite, > 1;
* ``rollout.n`` and the sequences of a step (``data.train_batch_size x rollout.n``): at most
  :data:`MAX_SEQUENCES_PER_STEP`;
* every per-GPU token budget (``*max_token_len_per_gpu``): an integer in [1, :data:`MAX_TOKEN_BUDGET`].
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import OmegaConf

__all__ = ["MAX_SEQUENCES_PER_STEP", "MAX_TOKEN_BUDGET", "check_run_values"]

ARR = "actor_rollout_ref"
# A step's responses are generated, scored and trained in one go: 2**20 is 128 x the largest preset's 8,192.
MAX_SEQUENCES_PER_STEP = 2**20
# The packed rows' offsets (cu_seqlens) of verl's flash-attention path are int32.
MAX_TOKEN_BUDGET = 2**31 - 1
TOKEN_BUDGETS = (
    f"{ARR}.actor.ppo_max_token_len_per_gpu",
    f"{ARR}.ref.log_prob_max_token_len_per_gpu",
    f"{ARR}.rollout.log_prob_max_token_len_per_gpu",
    "critic.ppo_max_token_len_per_gpu",
    "critic.forward_max_token_len_per_gpu",
)
LEARNING_RATES = (f"{ARR}.actor.optim.lr", "critic.optim.lr")
CLIP_RATIOS = (
    f"{ARR}.actor.clip_ratio",
    f"{ARR}.actor.clip_ratio_low",
    f"{ARR}.actor.clip_ratio_high",
    f"{ARR}.actor.policy_loss.clip_ratio",
    "critic.cliprange_value",
)


def _get(config: Any, key: str) -> Any:
    return OmegaConf.select(config, key, default=None)


def _integer(config: Any, key: str, low: int, high: int | None = None, null_ok: bool = False) -> int | None:
    value = _get(config, key)
    if value is None and null_ok:
        return None
    what = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"{key}={value!r}: must be {what}{' or null' if null_ok else ''}")
    return value


def _real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _finite(config: Any, key: str, low: float, high: float | None, valid: str) -> None:
    """``key`` (when set) a finite number with ``low < value`` (and ``value <= high``); ``valid`` says so."""
    value = _get(config, key)
    if value is None:
        return
    number = _real(value)
    if number is None or not math.isfinite(number) or number <= low or (high is not None and number > high):
        raise ValueError(f"{key}={value!r}: must be {valid}")


def check_run_values(config: Any) -> None:
    """Refuse the first value above that no run can train with (``ValueError``, one line naming the key)."""
    _integer(config, "trainer.total_training_steps", 1, null_ok=True)
    _integer(config, "trainer.total_epochs", 1)
    for key in LEARNING_RATES:
        _finite(config, key, 0.0, None, "a finite number > 0")
    for key in CLIP_RATIOS:
        _finite(config, key, 0.0, 1.0, "a finite number in (0, 1]")
    _finite(config, f"{ARR}.actor.clip_ratio_c", 1.0, None, "a finite number > 1 (the dual-clip bound)")
    n = _integer(config, f"{ARR}.rollout.n", 1, MAX_SEQUENCES_PER_STEP)
    batch = _get(config, "data.train_batch_size")
    if isinstance(batch, int) and not isinstance(batch, bool) and batch * n > MAX_SEQUENCES_PER_STEP:
        raise ValueError(
            f"data.train_batch_size={batch} x {ARR}.rollout.n={n} = {batch * n} sequences per step: must be at most "
            f"{MAX_SEQUENCES_PER_STEP} (generated, scored and trained in one go)"
        )
    for key in TOKEN_BUDGETS:
        if _get(config, key) is not None:
            _integer(config, key, 1, MAX_TOKEN_BUDGET)
