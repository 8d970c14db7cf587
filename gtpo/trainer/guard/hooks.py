"""The run guards' hooks in verl's trainer: stage deadlines on the weight sync and generation, and the start-up check
of the reward workers (:class:`GuardHooks`)."""

from __future__ import annotations

from gtpo.trainer.guard import startup_checks, watchdog

__all__ = ["GuardHooks"]


class GuardHooks:
    """A stalled stage or a broken start fails the run, naming why. Overrides:

    * ``on_init_end``: before verl's first weight sync (in the base class's ``on_init_end``) each sync gets its
      deadline (:func:`.watchdog.watch_weight_sync`); after it, a reward worker that failed in its constructor stops
      the run with its own error (:func:`.startup_checks.check_reward_workers`);
    * ``_build_replay_buffer``: generation that stops making progress fails within ``algorithm.watchdog.generation_s``
      (:func:`.watchdog.watch_generation`, wrapping the buffer the classes after this one built; seam
      ``generation-watchdog``, docs/architecture.md).
    """

    def on_init_end(self):
        watchdog.watch_weight_sync(self)
        super().on_init_end()
        startup_checks.check_reward_workers(self)

    def _build_replay_buffer(self):
        return watchdog.watch_generation(super()._build_replay_buffer(), self)
