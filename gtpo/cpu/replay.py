"""Fast-polling replay buffer for verl 0.9.1's v1 trainer (CPU tests and demos).

verl's ``ReplayBuffer`` sleeps ``poll_interval`` (2 s, no config key) between TransferQueue polls while it waits for
a batch of finished rollout groups. On a tiny CPU run generation takes ~0.2 s, so every step waits ~2 s for nothing.
``trainer.v1.sampler.custom_sampler.{path,name}`` (``PPOTrainer._build_replay_buffer``) lets a subclass replace it:
``path: pkg://gtpo.cpu.replay``, ``name: FastPollReplayBuffer``.

The result behaves like the built-in buffer of the current trainer (``ReplayBuffer`` for ``sync`` and for registered
subclasses of ``PPOTrainerSync``, ``ReplayBufferAsync`` otherwise); only the poll interval changes
(``trainer.v1.sampler.sampler_kwargs.poll_interval``, default 0.05 s).

One subtlety of verl 0.9.1: for a custom sampler the trainer drops the built-in keyword arguments (DAPO
``filter_groups_metric``, ``train_batch_size``, ``gen_batch_size``, ``max_inflight_gen_batches``,
``sync_refill_failed_groups``), which would silently switch DAPO group filtering off. They are recovered from the
trainer that owns ``refill_fn`` (a bound method of ``PPOTrainer``) with the same rules the trainer applies.
(verl itself picks ``ReplayBufferAsync`` for every mode name other than ``sync``, including sync subclasses
registered under another name; here the trainer's class decides.)
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync

DEFAULT_POLL_INTERVAL_S = 0.05


def _builtin_kwargs(trainer: Any, sync: bool) -> dict[str, Any]:
    """The keyword arguments ``PPOTrainer._build_replay_buffer`` gives its built-in buffer."""
    sampler_config = trainer.config.trainer.v1.sampler
    filter_groups_metric = trainer._resolve_filter_groups_metric()
    sync_refill = bool(sampler_config.get("sync_refill_failed_groups", False))
    kwargs: dict[str, Any] = dict(filter_groups_metric=filter_groups_metric, sync_refill_failed_groups=sync_refill)
    if sync:
        train_batch_size = trainer.config.data.train_batch_size
        filter_groups = trainer.config.algorithm.get("filter_groups", None)
        if filter_groups_metric is not None or sync_refill:
            gen_batch_size = 1
        else:
            gen_batch_size = trainer.config.data.get("gen_batch_size", None) or train_batch_size
        max_inflight = filter_groups.get("max_inflight_gen_batches", 1) if filter_groups_metric is not None else 1
        kwargs.update(
            train_batch_size=train_batch_size, gen_batch_size=gen_batch_size, max_inflight_gen_batches=max_inflight
        )
    return kwargs


def _is_sync_trainer(trainer: Any) -> bool:
    """A registered subclass of verl's sync trainer (e.g. ``trainer_mode=gtpo_sync``) keeps sync sampling."""
    if trainer is None:
        return False
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    return isinstance(trainer, PPOTrainerSync)


def _poll_interval(sampler_kwargs: Any) -> float:
    value = (sampler_kwargs or {}).get("poll_interval", DEFAULT_POLL_INTERVAL_S)
    value = float(value)
    if value <= 0:
        raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval={value}: must be > 0")
    return value


class _FastPollSync(ReplayBuffer):
    pass


class _FastPollAsync(ReplayBufferAsync):
    pass


def FastPollReplayBuffer(**kwargs: Any) -> ReplayBuffer:  # noqa: N802 (used as a class by verl's config)
    """Build the built-in replay buffer of ``kwargs['trainer_mode']`` with a short poll interval."""
    refill_fn = kwargs.get("refill_fn")
    trainer = getattr(refill_fn, "__self__", None)
    sync = kwargs.get("trainer_mode") == "sync" or _is_sync_trainer(trainer)
    kwargs.setdefault("poll_interval", _poll_interval(kwargs.get("sampler_kwargs")))
    if (
        "filter_groups_metric" not in kwargs
        and trainer is not None
        and hasattr(trainer, "_resolve_filter_groups_metric")
    ):
        for key, value in _builtin_kwargs(trainer, sync).items():
            kwargs.setdefault(key, value)
    cls = _FastPollSync if sync else _FastPollAsync
    return cls(**kwargs)
