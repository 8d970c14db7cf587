"""DAPO dynamic sampling with a generation-round limit on verl 0.9.1's v1 sync trainer.

DAPO (arXiv 2503.14476, §3.2 / Alg. 1) keeps sampling until the batch holds ``train_batch_size`` groups whose
accuracy is neither all 0 nor all 1, and gives up after ``max_num_gen_batches`` generation batches.

What verl 0.9.1 provides: ``algorithm.filter_groups.{enable, metric, max_inflight_gen_batches}`` drives the v1
sync ``ReplayBuffer``: a finished group whose metric has zero spread (more than one response, ``np.std == 0``) is
evicted and ``2k`` replacement prompts are dispatched per ``k`` evictions, bounded in concurrency by
``max_inflight_gen_batches * train_batch_size`` in-flight prompts; once enough groups are sampleable the in-flight
ones are drained and the surplus is discarded. What it lacks: ``max_num_gen_batches`` is read only to log that it
is ignored, so a run whose groups all saturate (every answer right, or every answer wrong) refills forever.

:class:`BoundedDapoReplayBuffer` adds the limit without copying verl's sampling loop: it wraps the replay buffer's
``refill_fn`` so that one ``sample()`` call dispatches at most ``(max_num_gen_batches - 1) * train_batch_size``
replacement prompts (the first generation batch is the step's own ``train_batch_size`` prompts), and it raises a
``RuntimeError`` (as DAPO's trainer does) when that budget is spent, nothing is in flight and the batch is still
short. ``max_num_gen_batches <= 0`` means no limit (verl's convention). The number of generation rounds used is
logged as ``training/filter_groups/num_gen_batches``.

Resume: the round counter and the refill budget are reset at every ``sample()`` call, so nothing of this class
outlives a step and a checkpoint needs none of it. The replacement prompts come from verl's dataloader, whose
position verl saves with each checkpoint (``data.pt``), so a resumed run draws what the uninterrupted run would have.
"""

from __future__ import annotations

from typing import Any

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

__all__ = ["BoundedDapoReplayBuffer", "bound_generation_rounds"]

ROUNDS_METRIC = "training/filter_groups/num_gen_batches"


class BoundedDapoReplayBuffer(ReplayBuffer):
    """verl's sync ``ReplayBuffer`` with DAPO's ``max_num_gen_batches`` enforced (see the module docstring)."""

    def __init__(self, *args: Any, max_num_gen_batches: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._setup_round_limit(max_num_gen_batches)

    @classmethod
    def from_replay_buffer(cls, buffer: ReplayBuffer, max_num_gen_batches: int) -> BoundedDapoReplayBuffer:
        """Turn an already-built sync ``ReplayBuffer`` (verl's ``_build_replay_buffer`` output) into this class: its
        ``__dict__`` as ``ReplayBuffer.__init__`` set it (seam ``dapo-round-limit``, docs/architecture.md)."""
        if type(buffer) is not ReplayBuffer:
            raise ValueError(
                f"max_num_gen_batches can only bound verl's sync ReplayBuffer, got {type(buffer).__name__} "
                "(async trainers and custom samplers own their refill policy)"
            )
        bounded = cls.__new__(cls)
        bounded.__dict__.update(buffer.__dict__)
        bounded._setup_round_limit(max_num_gen_batches)
        return bounded

    def _setup_round_limit(self, max_num_gen_batches: int) -> None:
        if isinstance(max_num_gen_batches, bool) or not isinstance(max_num_gen_batches, int):
            raise ValueError(f"max_num_gen_batches={max_num_gen_batches!r}: must be an integer (<= 0: no limit)")
        self.max_num_gen_batches = max_num_gen_batches
        self._unbounded_refill = self.refill_fn
        self._refill_budget: int | None = None
        self._refilled = 0
        self._budget_denied = False
        if self.refill_fn is not None:
            self.refill_fn = self._bounded_refill

    def _bounded_refill(self, num_prompts: int):
        if self._refill_budget is None:
            return self._unbounded_refill(num_prompts)
        allowed = min(num_prompts, self._refill_budget - self._refilled)
        step = self.gen_batch_size or 1
        allowed -= allowed % step
        if allowed < num_prompts:
            self._budget_denied = True
        if allowed <= 0:
            return 0
        self._refilled += allowed
        return self._unbounded_refill(allowed)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        limited = partition_id != "val" and self.filter_groups_metric is not None and self.max_num_gen_batches > 0
        if not limited:
            return super().sample(global_steps, partition_id, batch_size)
        self._refill_budget = (self.max_num_gen_batches - 1) * int(self.train_batch_size)
        self._refilled = 0
        self._budget_denied = False
        self._short_batch_size = batch_size
        try:
            batch, metrics = super().sample(global_steps, partition_id, batch_size)
        finally:
            self._refill_budget = None
        metrics[ROUNDS_METRIC] = 1.0 + self._refilled / float(self.train_batch_size)
        return batch, metrics

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        if self._refill_budget is not None and self._budget_denied:
            inflight = len(self.pending_keys[partition_id]) + len(self.running_keys[partition_id])
            if inflight == 0:
                raise RuntimeError(
                    f"dynamic sampling: algorithm.filter_groups.max_num_gen_batches={self.max_num_gen_batches} "
                    f"generation rounds ({self._refilled} replacement prompts) did not yield "
                    f"{self._short_batch_size} groups with mixed {self.filter_groups_metric!r}; the data may be too "
                    "easy or too hard for the policy (raise the limit, or set it <= 0 for no limit)"
                )
        return super()._wait_for_next_poll(partition_id, last_debug_time)


def bound_generation_rounds(buffer: ReplayBuffer, algorithm_config: Any) -> ReplayBuffer:
    """Apply ``algorithm.filter_groups.max_num_gen_batches`` to a freshly built replay buffer when it matters.

    Returns ``buffer`` unchanged unless filtering is enabled, the limit is positive and ``buffer`` is verl's sync
    ``ReplayBuffer``; otherwise a :class:`BoundedDapoReplayBuffer` with the same state.
    """
    fg = algorithm_config.get("filter_groups", None) if algorithm_config is not None else None
    if fg is None or not bool(fg.get("enable", False)):
        return buffer
    limit = fg.get("max_num_gen_batches", 0)
    if limit is None or int(limit) <= 0 or buffer.filter_groups_metric is None:
        return buffer
    return BoundedDapoReplayBuffer.from_replay_buffer(buffer, int(limit))
