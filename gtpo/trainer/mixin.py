"""The recipe's trainer behaviour, defined once and combined with each of verl 0.9.1's v1 trainers.

verl 0.9.1 computes the old policy's per-token entropy in the old-log-prob pass and stores it in TransferQueue,
but ``PPOTrainer._compute_advantage`` fetches neither it nor the response token ids, and passes an estimator only
``token_level_rewards, response_mask, index, config``. :class:`GTPOTrainerMixin` overrides that one method. For the
recipe's estimators (``gtpo``, ``grpo_s``, ``gtpo_traj``) it:

1. fetches the base method's fields plus ``entropy`` and ``responses`` (no extra forward pass);
2. keeps the base class's steps: KL-in-reward (``algorithm.use_kl_in_reward``) and rollout correction
   (IS weights / rejection sampling in decoupled mode);
3. calls the registered estimator with ``entropy=``, ``responses=`` and ``metrics=`` keyword arguments, on the real
   rows only (verl's synthetic padding rows, tagged ``is_padding``, get zero advantage and stay out of the
   statistics);
4. writes advantages and returns back, as the base method does.

Each call also logs how much of the batch it saw, ``<estimator>/estimator_rows`` (responses) and
``<estimator>/estimator_groups`` (prompts), ``<estimator>/estimator_calls_total`` (calls per step), and the groups
that failed rollout sessions left short of ``rollout.n`` (``<estimator>/min_group_size``,
``<estimator>/short_groups_total``; ``algorithm.groups.refuse_short`` fails the step instead:
:mod:`gtpo.trainer.group_sizes`): under ``separate_async`` verl's step calls the advantage computation once per
``parameter_sync_step`` slice, so the batch-scope statistics cover a slice, not the step (verl's metrics aggregator
averages the first two over the calls, sums the ``_total`` counts and takes the smallest group size). The forking
loss's ``scope=batch`` threshold logs ``forking/batch_scope_rows`` likewise.

Every other estimator (``grpo``, ``gae``, ...) goes through the base method unchanged, so baselines run the
exact verl code path. Also here: DAPO's ``max_num_gen_batches`` round limit (sync only: verl 0.9.1 ignores it),
the forking-token loss in the actor workers (``algorithm.forking.enable``), per-token dumps and tracker heatmaps
(``_log_rollout_data``), paper A's Table 1 columns in validation (``_val_metrics_update``), and resume: each
checkpoint also gets the recipe's state (``checkpoint_state``: ``gtpo_traj``'s measured ``<H>_ini``), written last,
so it marks the checkpoint complete, and restored on resume; ``resume_mode=auto`` starts from the newest complete
checkpoint whatever state a kill during a save left the tracker in (``checkpoints``); after a resume at step N the
trackers hold each step once (``metric_history``: the file log rewritten to steps <= N, TensorBoard's purge_step).

Entropy under asynchrony (``colocate_async``, ``separate_async``): a response may be generated across several
policy versions (partial rollout: aborted at a weight sync, resumed with the new weights), and the rollout engine
returns no entropy. The estimators therefore use the entropy recomputed by verl's old-log-prob pass, i.e. of the
policy about to be updated (pi_old, one version for the whole response; under ``separate_async`` the version saved
at the start of the ``parameter_sync_step`` cycle). Rollout correction's ``bypass_mode`` skips that pass, so it is
refused at startup for the recipe's estimators (:mod:`gtpo.launch.async_checks`). Beside the estimator's
metrics, every step logs the staleness verl measures, as ``<estimator>/trajectory_staleness_{mean,max}`` and
``<estimator>/trajectory_spans_max`` (0, 0 and 1 under the sync trainer).

The mixin is a plain class: it must come first in the bases, before one of verl's trainers
(:mod:`gtpo.trainer.modes`).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.utils.debug import marked_timer
from verl.workers.utils.padding import response_to_nested

from gtpo.algorithms.token_selection import FRACTION_KEY, THRESHOLD_KEY, batch_threshold_extra_info
from gtpo.knobs import GroupParams
from gtpo.methods import knob, recipe_estimator
from gtpo.trainer.dynamic_sampling import bound_generation_rounds
from gtpo.trainer.group_sizes import group_size_metrics
from gtpo.trainer.guard import startup_checks, watchdog
from gtpo.trainer.observe import metric_history
from gtpo.trainer.preemption.stop import TrainerStop
from gtpo.trainer.resume import checkpoint_state, checkpoint_world_size, checkpoints
from gtpo.trainer.resume.reshard import finish_interrupted_reshards
from gtpo.verl_plugin import actor_loss

# verl's staleness metrics (PPOTrainer._compute_metrics) -> the suffix they are also logged under, per estimator.
STALENESS_METRICS = {
    "training/off_policy/trajectory_staleness/mean": "trajectory_staleness_mean",
    "training/off_policy/trajectory_staleness/max": "trajectory_staleness_max",
    "training/off_policy/trajectory_spans/max": "trajectory_spans_max",
}


class GTPOTrainerMixin:
    """The recipe's behaviour on top of a verl v1 trainer; subclasses set the two class attributes below."""

    # The name the class is registered under (trainer.v1.trainer_mode), e.g. "gtpo_colocate_async".
    REGISTERED_MODE: str = ""
    # The mode verl's base class branches on (replay buffer class, dataloader refill, checkpoint load/save, the
    # trainer.v1.<mode> config block): "sync", "colocate_async" or "separate_async".
    VERL_MODE: str = ""

    def __init__(self, config):
        super().__init__(config)
        # The recipe's state goes into each checkpoint last, from the callback verl calls after the tracker write.
        self.checkpoint_callback = checkpoint_state.StateAfterSave(self.checkpoint_callback, self.recipe_state)

    @property
    def recipe_state(self) -> dict:
        """This trainer's cross-step state (``checkpoint_state``): saved with each checkpoint, restored on resume."""
        return self.__dict__.setdefault("_recipe_state", checkpoint_state.new_state())

    @property
    def trainer_mode(self) -> str:
        return self.VERL_MODE

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        if value != self.REGISTERED_MODE:
            raise ValueError(f"trainer.v1.trainer_mode={value!r} selects another trainer than {self.REGISTERED_MODE}")

    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        # verl's ReplayBuffer polls TransferQueue every 2 s with no config key; a step whose generation takes less
        # (the CPU backend, small debug runs) would wait for nothing. trainer.v1.sampler.sampler_kwargs.poll_interval
        # sets it (verl stores sampler_kwargs on the buffer but does not read this key).
        poll_interval = self.config.trainer.v1.sampler.get("sampler_kwargs", {}).get("poll_interval", None)
        if poll_interval is not None:
            if not float(poll_interval) > 0:
                raise ValueError(f"trainer.v1.sampler.sampler_kwargs.poll_interval={poll_interval!r}: must be > 0 s")
            buffer.poll_interval = float(poll_interval)
        # A generation that stops making progress fails within algorithm.watchdog.generation_s, naming the stage.
        return watchdog.watch_generation(bound_generation_rounds(buffer, self.config.algorithm), self)

    def on_init_end(self):
        # Before verl's first weight sync (in the base class's on_init_end): each sync gets its deadline.
        watchdog.watch_weight_sync(self)
        super().on_init_end()
        # A reward worker that failed in its constructor stops the run here, with its own error.
        startup_checks.check_reward_workers(self)
        # Installs the forking-token loss in every actor worker; None unless algorithm.forking.enable.
        self._forking = actor_loss.install(self)

    def fit(self, agent_loop_manager):
        # After a resume the trackers keep the steps up to the checkpoint's, once each (verl's file logger would
        # truncate its log; TensorBoard would show the killed run's later steps beside the resumed ones).
        self._metric_history = metric_history.MetricHistory.for_trainer(self.config.trainer, self.global_steps)
        # Stop requests (signals to the driver) and the job's deadline, checked at every step boundary.
        self._preemption = TrainerStop(knob(self.config.algorithm, "preemption"))
        return super().fit(agent_loop_manager)

    def on_step_begin(self):
        # Ends the run here, after the stopping step's metrics were logged (raises PreemptedError).
        self._preemption.before_step(self)
        super().on_step_begin()

    def on_step_end(self):
        # Saved for a stop: no weight sync, nothing generates for this run again.
        if self._preemption.after_step(self):
            return
        super().on_step_end()

    def _validate(self):
        if self.__dict__.get("_preemption") is not None and self._preemption.skip_validation():
            return {}
        return super()._validate()

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

    def _save_checkpoint(self):
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        # A state file left in this folder by an abandoned attempt at this step would mark a half-written save
        # complete (the callback writes the new one once verl is done); that attempt's shards of another world size
        # would make the folder mix two sizes.
        checkpoint_state.discard_state(folder)
        checkpoint_world_size.discard_other_world_sizes(folder, self._world_size())
        preemption = self.__dict__.get("_preemption")
        with preemption.timed_save(self) if preemption is not None else contextlib.nullcontext():
            super()._save_checkpoint()
            self._prune_checkpoints()

    def _checkpoint_layout(self) -> checkpoints.CheckpointLayout:
        return checkpoints.layout_of(self.config, bool(self.use_critic), async_mode=self.trainer_mode != "sync")

    def _load_checkpoint(self):
        trainer_cfg = self.config.trainer
        resolved = None
        if trainer_cfg.resume_mode == "auto":
            # Before verl's own lookup, which fails on an empty tracker and trusts a half-written folder.
            finish_interrupted_reshards(trainer_cfg.default_local_dir)
            resolved = checkpoints.resolve_auto_resume(trainer_cfg.default_local_dir, self._checkpoint_layout())
        elif trainer_cfg.resume_mode == "resume_path" and isinstance(trainer_cfg.resume_from_path, str):
            resolved = os.path.abspath(trainer_cfg.resume_from_path)  # as verl resolves it
        if resolved is not None:
            # Before any worker loads: at another world size each one would fail on a shard file that does not exist.
            checkpoint_world_size.match_resume_world_size(resolved, self.config, self._checkpoint_layout())
        super()._load_checkpoint()
        if self.global_steps > 0:
            folder = self._resumed_checkpoint_folder(resolved)
            restored = checkpoint_state.restore_state(folder, self.config.algorithm, self.recipe_state)
            print(f"gtpo: resumed from {folder} at step {self.global_steps}; recipe state restored: {restored}")

    def _resumed_checkpoint_folder(self, resolved: str | None) -> str:
        """The ``global_step_<N>`` folder verl's ``_load_checkpoint`` resumed from (``resolved`` by ours)."""
        folder = resolved
        if self.config.trainer.resume_mode == "resume_path" and folder is not None:
            reasons = checkpoints.incomplete_reasons(folder, self.global_steps, self._checkpoint_layout())
            if reasons:
                # the user named this folder: loaded as asked, but said
                print(f"gtpo: warning: trainer.resume_from_path={folder} is incomplete: {', '.join(reasons)}")
        if folder is None or os.path.basename(os.path.normpath(folder)) != f"global_step_{self.global_steps}":
            raise RuntimeError(f"resumed at step {self.global_steps} but the checkpoint folder resolves to {folder}")
        return folder

    def _world_size(self) -> int:
        """The actor's world size: in every trainer mode verl's actor (and critic) workers fill the global resource
        pool, ``trainer.nnodes x trainer.n_gpus_per_node`` GPUs."""
        return int(self.config.trainer.nnodes) * int(self.config.trainer.n_gpus_per_node)

    def _prune_checkpoints(self) -> None:
        """After a save: keep ``trainer.max_actor_ckpt_to_keep`` (``max_critic_ckpt_to_keep``) checkpoints on disk,
        counting those of earlier attempts too, which verl's in-process count forgets at each resume."""
        message = checkpoints.prune_for_trainer(self.config.trainer, self.global_steps, self._checkpoint_layout())
        if message:
            print(message)

    def _compute_metrics(self, batch: KVBatchMeta, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        estimator = str(self.config.algorithm.adv_estimator)
        if recipe_estimator(estimator) is not None:
            # How many policy versions the shaped responses lag behind / span, next to the estimator's own metrics.
            metrics.update(
                {f"{estimator}/{name}": metrics[key] for key, name in STALENESS_METRICS.items() if key in metrics}
            )

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        params = getattr(self, "_forking", None)
        if params is not None and params.scope == "batch":
            # Whole-batch quantile of the old-policy entropy, handed to the workers' loss through extra_info.
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["entropy", "response_mask"]
            )
            info = batch_threshold_extra_info(
                data["entropy"].to_padded_tensor(0.0), data["response_mask"].to_padded_tensor(0), params.rho
            )
            batch.extra_info.update(info)
            metrics["forking/batch_entropy_threshold"] = info[THRESHOLD_KEY]
            metrics["forking/batch_selected_frac"] = info[FRACTION_KEY]
            # the rows the quantile was taken over: the step's batch, or one parameter_sync_step slice of it
            metrics["forking/batch_scope_rows"] = float(sum(not t.get("is_padding", False) for t in batch.tags))
        return super()._update_actor(batch, metrics)

    def _log_rollout_data(self, batch: KVBatchMeta, timing_raw: dict, rollout_data_dir: str):
        """verl's text dump ``<step>.jsonl``, plus ``tokens_<step>.jsonl`` with per-token advantages and entropy.

        Read by ``python -m gtpo.viz tokens``; a few groups per step, so it costs milliseconds. With ``tensorboard``
        or ``wandb`` in ``trainer.logger``, the step's heatmap also goes to the tracker (:mod:`gtpo.viz.tracker`).
        """
        from gtpo.viz.dump_writer import records_from_batch, write_token_dump
        from gtpo.viz.tracker import log_token_heatmap, wants_heatmap

        super()._log_rollout_data(batch, timing_raw, rollout_data_dir)
        with marked_timer("dump_token_records", timing_raw, color="green"):
            keys = [k for k, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
            fields = ["uid", "prompts", "responses", "rm_scores", "advantages", "extra_fields"]
            rollout_corr = self.config.algorithm.get("rollout_correction", None)
            if not (rollout_corr and rollout_corr.get("bypass_mode", False)):
                fields.append("entropy")  # bypass mode computes no old-policy entropy
            data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields)
            records = records_from_batch(
                data, tokenizer=self.tokenizer, step=self.global_steps, keys=keys, max_groups=8
            )
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

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        algorithm = self.config.algorithm
        if recipe_estimator(str(algorithm.adv_estimator)) is None:
            return super()._compute_advantage(batch, metrics)

        # verl's method copied for two more fields, only (3) differs (docs/architecture.md, Seams: advantage-fields)
        fields = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]
        fields += ["entropy", "responses"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        nested_response_mask = data["response_mask"]
        data = DataProto(batch=data.to_padded_tensor())
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)

        # (1) KL in reward, exactly as the base class.
        if algorithm.use_kl_in_reward:
            data, kl_metrics = apply_kl_penalty(data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]

        # (2) Rollout correction, exactly as the base class (decoupled mode only).
        rollout_corr_config = algorithm.get("rollout_correction", None)
        bypass = bool(rollout_corr_config and rollout_corr_config.get("bypass_mode", False))
        rollout_correction = rollout_corr_config is not None and "rollout_log_probs" in data.batch and not bypass
        if rollout_correction:
            data, is_metrics = compute_rollout_correction_and_add_to_batch(data, rollout_corr_config)
            metrics.update(is_metrics)

        # (3) The estimator, on the real rows only.
        data.batch["advantages"], data.batch["returns"] = self._recipe_advantages(data, batch, metrics)

        # (4) Write back, as the base class.
        out_fields = ["advantages", "returns"]
        if algorithm.use_kl_in_reward:
            out_fields.append("token_level_rewards")
        if rollout_correction:
            out_fields.append("response_mask")
            if "rollout_is_weights" in data.batch:
                out_fields.append("rollout_is_weights")
        output = {f: response_to_nested(data.batch[f], nested_response_mask) for f in out_fields}
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(output, batch_size=len(batch))
        )

    def _group_params(self) -> GroupParams:
        return knob(self.config.algorithm, "groups")

    def _recipe_advantages(
        self, data: DataProto, batch: KVBatchMeta, metrics: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the registered estimator on the real rows; verl's synthetic padding rows get zeros."""
        algorithm = self.config.algorithm
        token_level_rewards = data.batch["token_level_rewards"]
        real = torch.as_tensor([not tag.get("is_padding", False) for tag in batch.tags], dtype=torch.bool)
        rows = real.nonzero(as_tuple=True)[0]

        def real_rows(name: str) -> torch.Tensor | None:
            return data.batch[name][rows] if name in data.batch.keys() else None

        name = str(algorithm.adv_estimator)
        estimator = get_adv_estimator_fn(name)
        index = data.non_tensor_batch["uid"][rows.numpy()]
        # What the batch-scope statistics of this call cover (one parameter_sync_step slice under separate_async).
        metrics[f"{name}/estimator_rows"] = float(len(index))
        metrics[f"{name}/estimator_groups"] = float(len(set(index.tolist())))
        metrics[f"{name}/estimator_calls_total"] = 1.0
        # Groups that failed rollout sessions left short of rollout.n responses: logged, or refused.
        metrics.update(
            group_size_metrics(
                index, int(self.config.actor_rollout_ref.rollout.n), name, self._group_params().refuse_short
            )
        )
        adv_real, ret_real = estimator(
            token_level_rewards=token_level_rewards[rows],
            response_mask=data.batch["response_mask"][rows],
            index=index,
            config=algorithm,
            entropy=real_rows("entropy"),
            responses=real_rows("responses"),
            metrics=metrics,
            global_steps=self.global_steps,
            state=self.recipe_state.get(name),  # the estimator's own block (gtpo_traj: its measured <H>_ini)
        )
        advantages = torch.zeros(token_level_rewards.shape, dtype=adv_real.dtype)
        returns = torch.zeros(token_level_rewards.shape, dtype=ret_real.dtype)
        advantages[rows] = adv_real
        returns[rows] = ret_real
        return advantages, returns
