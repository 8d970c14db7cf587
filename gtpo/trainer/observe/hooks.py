"""The recipe's additions to what verl's trainer logs and dumps (:class:`ObserveHooks`)."""

from __future__ import annotations

import os

from transfer_queue import KVBatchMeta
from verl.utils.debug import marked_timer

from gtpo.methods import ENTROPY, FIELDS, entropy_available, fields_needed, recipe_estimator
from gtpo.trainer.advantage import fetch_with_needs
from gtpo.trainer.observe.metric_history import MetricHistory

__all__ = ["STALENESS_METRICS", "ObserveHooks"]

# verl's staleness metrics (PPOTrainer._compute_metrics) -> the suffix they are also logged under, per estimator.
STALENESS_METRICS = {
    "training/off_policy/trajectory_staleness/mean": "trajectory_staleness_mean",
    "training/off_policy/trajectory_staleness/max": "trajectory_staleness_max",
    "training/off_policy/trajectory_spans/max": "trajectory_spans_max",
}
# What the token dump reads beside the method's needs (gtpo.viz.dump_writer.records_from_batch); response_mask marks
# the tool-output tokens of multi-turn responses.
DUMP_FIELDS = ["uid", "prompts", "responses", "response_mask", "rm_scores", "advantages", "extra_fields"]


class ObserveHooks:
    """Metrics, dumps and the trackers' history on a verl v1 trainer. Overrides:

    * ``fit``, ``on_validate_begin``, ``on_train_begin``: after a resume at step N the trackers hold each step once
      (:mod:`.metric_history`), applied to verl's ``Tracking`` in whichever of the two hooks verl calls first, before
      its first log (seam ``metric-history-hooks``);
    * ``_log_rollout_data``: verl's text dump, plus per-token dumps and the tracker heatmap (seam ``rollout-dump``);
    * ``_val_metrics_update``: paper A's Table 1 columns and the unbiased pass@k ladder beside verl's metrics (seam
      ``validation-columns``);
    * ``_compute_metrics``: verl's staleness of the shaped responses also under the estimator's prefix,
      ``<estimator>/trajectory_staleness_{mean,max}`` and ``<estimator>/trajectory_spans_max`` (0, 0 and 1 under the
      sync trainer; seam ``staleness-metrics``).

    What the history does to verl's trackers is the seam ``tracker-internals``; each seam is a row of the Seams table
    in docs/architecture.md.
    """

    def fit(self, agent_loop_manager):
        # verl's file logger would truncate its log; TensorBoard would show the killed run's later steps.
        self._metric_history = MetricHistory.for_trainer(self.config.trainer, self.global_steps)
        return super().fit(agent_loop_manager)

    def on_validate_begin(self):
        self._attach_metric_history()
        super().on_validate_begin()

    def on_train_begin(self):
        self._attach_metric_history()
        super().on_train_begin()

    def _attach_metric_history(self) -> None:
        """Apply the history to verl's ``Tracking`` (``self.logger``) once, before anything is logged: verl's
        ``fit()`` builds it, then calls ``on_validate_begin`` (validation before training) or ``on_train_begin``
        before its first ``self.logger.log``."""
        history = self.__dict__.pop("_metric_history", None)
        if history is not None:
            history.attach(self.logger)

    def _compute_metrics(self, batch: KVBatchMeta, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        estimator = str(self.config.algorithm.adv_estimator)
        if recipe_estimator(estimator) is not None:
            # How many policy versions the shaped responses lag behind / span, next to the estimator's own metrics.
            metrics.update(
                {f"{estimator}/{name}": metrics[key] for key, name in STALENESS_METRICS.items() if key in metrics}
            )

    def _log_rollout_data(self, batch: KVBatchMeta, timing_raw: dict, rollout_data_dir: str):
        """verl's text dump ``<step>.jsonl``, plus ``tokens_<step>.jsonl``: per-token advantages and, whenever verl's
        old-log-prob pass computed it, the old policy's entropy (every method's heatmap shows it).

        Read by ``python -m gtpo.viz tokens``; a few groups per step, so it costs milliseconds. With ``tensorboard``
        or ``wandb`` in ``trainer.logger``, the step's heatmap also goes to the tracker (:mod:`gtpo.viz.tracker`).
        """
        from gtpo.viz.dump_writer import records_from_batch, write_token_dump
        from gtpo.viz.tracker import log_token_heatmap, wants_heatmap

        super()._log_rollout_data(batch, timing_raw, rollout_data_dir)
        algorithm = self.config.algorithm
        with marked_timer("dump_token_records", timing_raw, color="green"):
            keys = [k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
            shown = (*fields_needed(algorithm), *((ENTROPY,) if entropy_available(algorithm) else ()))
            data = fetch_with_needs(batch, algorithm, DUMP_FIELDS, needs=shown, keys=keys)
            records = records_from_batch(
                data, tokenizer=self.tokenizer, step=self.global_steps, keys=keys, max_groups=8,
                entropy_field=FIELDS[ENTROPY],
            )  # fmt: skip
            write_token_dump(records, os.path.join(rollout_data_dir, f"tokens_{self.global_steps}.jsonl"))
        if wants_heatmap(self.logger):
            with marked_timer("log_token_heatmap", timing_raw, color="green"):
                log_token_heatmap(self.logger, records, self.global_steps, os.path.join(rollout_data_dir, "heatmaps"))

    def _val_metrics_update(
        self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=None
    ) -> dict[str, float]:
        """verl's validation metrics plus paper A's Table 1 columns and the unbiased pass@k ladder.

        ``val-core/<data_source>/acc/{Mean@32,Pass@4,Pass@32}`` (paper A, Table 1; unbiased pass@k of Chen et al.
        2021) and ``val-aux/<data_source>/acc/pass@{1,2,4,...}`` sit beside verl's bootstrap ``best@k``. With
        ``trainer.validation_data_dir`` set, ``<step>.data_sources.json`` (prompt uid -> data_source) is written
        beside verl's ``<step>.jsonl`` dump, so ``python -m gtpo.eval`` needs no ``--data`` to split benchmarks.
        """
        from gtpo.eval.metrics import validation_pass_at_k, validation_table1

        metrics = super()._val_metrics_update(
            data_sources, sample_uids, reward_extra_infos_dict, sample_turns, expected_acc_counts=expected_acc_counts
        )
        accs = reward_extra_infos_dict["acc"] if "acc" in reward_extra_infos_dict else reward_extra_infos_dict["reward"]
        # Failed sessions count as incorrect, as in verl's own acc.
        counts = expected_acc_counts
        metrics.update(validation_table1(data_sources, sample_uids, accs, expected_counts=counts))
        metrics.update(validation_pass_at_k(data_sources, sample_uids, accs, expected_counts=counts, section="val-aux"))
        val_data_dir = self.config.trainer.get("validation_data_dir", None)
        if val_data_dir:
            from gtpo.eval.sources import write_data_sources

            write_data_sources(val_data_dir, self.global_steps, sample_uids, data_sources)
        return metrics
