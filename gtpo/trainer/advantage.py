"""The advantage hand-off: verl's advantage step, giving each recipe estimator what its method row needs.

verl 0.9.1 computes the old policy's per-token entropy in the old-log-prob pass and stores it in TransferQueue, but
``PPOTrainer._compute_advantage`` fetches neither it nor the response token ids, and calls an estimator with
``token_level_rewards, response_mask, index, config`` only. :class:`AdvantageHandoff` is the class the recipe swaps
into verl's trainers for that. What a method needs from the batch is its row's ``needs`` (:mod:`gtpo.methods`), read
by :func:`fetch_with_needs`, the one place the trainer fetches it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.ray_trainer import apply_kl_penalty
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.workers.utils.padding import response_to_nested

from gtpo.algorithms.token_positions import tool_turn_metrics
from gtpo.algorithms.token_selection import FRACTION_KEY, THRESHOLD_KEY, batch_threshold_extra_info
from gtpo.methods import ENTROPY, FIELDS, fields_needed, knob, recipe_estimator
from gtpo.trainer.group_sizes import group_size_metrics
from gtpo.verl_plugin import actor_loss

__all__ = ["AdvantageHandoff", "fetch_with_needs"]

# What verl's own _compute_advantage fetches (verl/trainer/ppo/v1/trainer_base.py, PPOTrainer._compute_advantage).
VERL_ADVANTAGE_FIELDS = [
    "uid",
    "response_mask",
    "rm_scores",
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_prob",
    "values",
]


def fetch_with_needs(
    batch: KVBatchMeta,
    algorithm: Any,
    fields: Sequence[str],
    needs: Iterable[str] | None = None,
    keys: Sequence[str] | None = None,
) -> TensorDict:
    """``fields`` of ``batch`` from TransferQueue, with the fields of ``needs`` (:data:`gtpo.methods.FIELDS` keys;
    default: what this config's method needs, :func:`gtpo.methods.fields_needed`).

    Only what the method needs is asked for: rollout correction's ``bypass_mode`` (no old-log-prob pass, so no
    entropy) is refused at launch for a method that needs the entropy, and every other method never asks for it.
    """
    needs = fields_needed(algorithm) if needs is None else needs
    select = list(dict.fromkeys([*fields, *(FIELDS[need] for need in needs)]))
    return tq.kv_batch_get(
        keys=batch.keys if keys is None else keys, partition_id=batch.partition_id, select_fields=select
    )


class AdvantageHandoff:
    """The recipe's advantage step on a verl v1 trainer. Overrides:

    * ``_compute_advantage``: for a recipe estimator, verl's method copied (seam ``advantage-fields``,
      docs/architecture.md) with the method's needs fetched too and the estimator called on the real rows only
      (verl's synthetic padding rows, tagged ``is_padding``, get zero advantage and stay out of the statistics); every
      other estimator (``grpo``, ``gae``, ...) runs verl's method unchanged;
    * ``_update_actor``: the forking loss's ``scope=batch`` threshold, a quantile of the old-policy entropy over the
      batch, handed to the workers' loss in ``batch.extra_info`` (seam ``forking-loss``);
    * ``on_init_end``: the actor loss installed in the workers (:func:`gtpo.verl_plugin.actor_loss.install`).

    Each estimator call logs what it saw: ``<estimator>/estimator_rows``, ``estimator_groups``,
    ``estimator_calls_total``, the groups failed rollout sessions left short (:mod:`gtpo.trainer.group_sizes`) and,
    with ``actor_rollout_ref.rollout.multi_turn.enable``, what the tool turns did
    (:func:`gtpo.algorithms.token_positions.tool_turn_metrics`).
    Under ``separate_async`` verl computes the advantages once per ``parameter_sync_step`` slice, so these (and
    ``forking/batch_scope_rows``) cover a slice. The estimator's cross-step state is its block of ``recipe_state``
    (:class:`gtpo.trainer.resume.hooks.ResumeHooks`, which saves and restores it).
    """

    def on_init_end(self):
        super().on_init_end()
        # The forking-token loss (or the min/max metrics loss) in every actor worker; the forking knobs, or None.
        self._forking = actor_loss.install(self)

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        algorithm = self.config.algorithm
        if recipe_estimator(str(algorithm.adv_estimator)) is None:
            return super()._compute_advantage(batch, metrics)

        # verl's method copied with the method's needs fetched too; only (3) differs (Seams: advantage-fields)
        data = fetch_with_needs(batch, algorithm, VERL_ADVANTAGE_FIELDS)
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
        index = data.non_tensor_batch["uid"][rows.numpy()]
        metrics[f"{name}/estimator_rows"] = float(len(index))
        metrics[f"{name}/estimator_groups"] = float(len(set(index.tolist())))
        metrics[f"{name}/estimator_calls_total"] = 1.0
        # Groups that failed rollout sessions left short of rollout.n responses: logged, or refused.
        refuse_short = knob(algorithm, "groups").refuse_short
        metrics.update(group_size_metrics(index, int(self.config.actor_rollout_ref.rollout.n), name, refuse_short))
        entropy = real_rows(FIELDS[ENTROPY])
        if self.config.actor_rollout_ref.rollout.multi_turn.get("enable", False) and entropy is not None:
            # what the tool turns did this step (ARPO's signal: the entropy of the first token after a tool output)
            used = tool_turn_metrics(data.batch["response_mask"][rows], entropy)
            metrics.update({f"{name}/{key}": value for key, value in used.items()})
        adv_real, ret_real = get_adv_estimator_fn(name)(
            token_level_rewards=token_level_rewards[rows],
            response_mask=data.batch["response_mask"][rows],
            index=index,
            config=algorithm,
            **{need: real_rows(field) for need, field in FIELDS.items()},  # entropy=, responses=: None if not needed
            metrics=metrics,
            global_steps=self.global_steps,
            state=self.recipe_state.get(name),  # the estimator's own block (gtpo_traj: its measured <H>_ini)
        )
        advantages = torch.zeros(token_level_rewards.shape, dtype=adv_real.dtype)
        returns = torch.zeros(token_level_rewards.shape, dtype=ret_real.dtype)
        advantages[rows] = adv_real
        returns[rows] = ret_real
        return advantages, returns

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        params = getattr(self, "_forking", None)
        if params is not None and params.scope == "batch":
            # Whole-batch quantile of the old-policy entropy, handed to the workers' loss through extra_info.
            data = fetch_with_needs(batch, self.config.algorithm, ["response_mask"], needs=(ENTROPY,))
            info = batch_threshold_extra_info(
                data[FIELDS[ENTROPY]].to_padded_tensor(0.0), data["response_mask"].to_padded_tensor(0), params.rho
            )
            batch.extra_info.update(info)
            metrics["forking/batch_entropy_threshold"] = info[THRESHOLD_KEY]
            metrics["forking/batch_selected_frac"] = info[FRACTION_KEY]
            # the rows the quantile was taken over: the step's batch, or one parameter_sync_step slice of it
            metrics["forking/batch_scope_rows"] = float(sum(not t.get("is_padding", False) for t in batch.tags))
        return super()._update_actor(batch, metrics)
