"""DAPO w/ Forking Tokens ("Beyond the 80/20 Rule", arXiv 2506.01939 v2, §5.1-5.2) on verl 0.9.1.

The policy gradient is restricted to the top-``rho`` highest-entropy response tokens, and the token-mean
denominator counts only those tokens (docs/ALGORITHMS.md §7.3). A registered policy loss cannot do this in verl 0.9.1:
it receives neither the entropy nor any way to change the denominator (``agg_loss`` normalises ``token-mean`` by
the global mini-batch token count ``batch_num_tokens`` that the engine computes from ``loss_mask``). The narrowest
correct hook is therefore a whole-loss replacement, installed with ``ActorRolloutRefWorker.set_loss_fn``:
:class:`ForkingPPOLoss` selects the tokens, then calls verl's own ``ppo_loss`` (clip, rollout-IS weights, KL and
entropy terms unchanged) on a shallow copy of the micro-batch whose ``response_mask`` is the selection and whose
``batch_num_tokens`` is the selected-token denominator.

Scopes (``algorithm.forking.scope``):

- ``micro_batch`` (the paper's micro-batch; the knob's default): the threshold is the top-rho quantile of the
  **training** policy's entropy
  (``model_output["entropy"]``, temperature-scaled logits, present when ``actor.calculate_entropy=true``) over the
  valid tokens of the micro-batch on this rank. The micro-batch loss is ``sum_sel l / n_sel(mb)`` (the paper's
  ``J^B``), and micro-batches and DP ranks are combined with verl's token weights ``n_valid(mb) / N`` (``N`` = the
  global mini-batch token count), i.e. ``batch_num_tokens_eff = N * n_sel(mb) / n_valid(mb)``. When each
  micro-batch selects exactly ``rho * n_valid(mb)`` tokens this equals ``sum_sel l / (rho * N)``: the global
  selected-count token-mean, independent of micro-batching and DP size.
- ``batch`` (the ``dapo_forking`` preset's: with token-budget micro-batches, as the GPU presets run, what a
  micro-batch holds depends on how the budget packed it, ``tests/test_path_equivalence.py``): the threshold is the
  top-rho quantile over the whole training batch (all ranks, all mini-batches) of
  the **old** policy's entropy (verl's old-log-prob recompute, stored in TransferQueue as ``entropy``), computed
  on the driver by :func:`gtpo.algorithms.token_selection.batch_threshold_extra_info`; tokens are selected on that
  same old entropy (a fixed mask per step; identical to the training policy's entropy for the first mini-batch).
  The denominator is ``rho_B * N`` with ``rho_B`` the batch's realised selected fraction, exact when the mini-batch
  is the batch.

The mask is built under ``no_grad`` from detached entropies: no gradient flows through it. Padding is never
selected. With ``entropy_coeff == 0`` (the preset's, and the paper's "no entropy loss") verl's ``ppo_loss`` gets the
entropy detached as well: it would otherwise add ``0 * entropy_loss`` to the loss, and that zero gradient makes the
backward recompute verl's checkpointed chunked entropy with autograd, keeping ``tokens x vocabulary x 4 B x 2`` (the
fp32 copy and softmax of every chunk, ~28 GiB at the 7B preset's 24,576-token budget) plus a third logits copy
(:mod:`gtpo.launch.memory_estimate`). The selection keeps the paper's definition: the training policy's
entropy of this very forward pass. Metrics (loss side, logged by verl as ``actor/forking/...``):
``forking/selected_token_frac``, ``forking/entropy_threshold`` (each micro-batch's threshold; averaged over
micro-batches, ranks and mini-batches like verl's own loss metrics). Any min / max metric of the policy loss inside
(``grpo_s/seq_ratio_min|max``) is aggregated as a min / max (:func:`gtpo.verl_plugin.loss_metrics.tag_extrema`).

:func:`install` is the recipe's one place that replaces verl's actor loss: :class:`ForkingPPOLoss` with forking
tokens, else the grpo_s policy loss's :class:`gtpo.verl_plugin.loss_metrics.GRPOSPPOLoss`. The trainer calls it
after ``init_workers`` as its ``install_actor_loss`` (:class:`gtpo.trainer.mixin.GTPOTrainerMixin`), which
:mod:`gtpo.verl_plugin.register` sets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gtpo.algorithms.token_selection import FRACTION_KEY, THRESHOLD_KEY, top_entropy_mask
from gtpo.knobs import load_knobs

__all__ = [
    "ForkingParams",
    "ForkingPPOLoss",
    "install",
    "load_params",
]

_SCOPES = ("micro_batch", "batch")


@dataclasses.dataclass(frozen=True)
class ForkingParams:
    """``algorithm.forking``: ``enable``, ``rho`` (kept fraction, paper 0.2), ``scope`` (micro_batch | batch)."""

    enable: bool = False
    rho: float = 0.2
    scope: str = "micro_batch"

    def __post_init__(self) -> None:
        if not isinstance(self.enable, bool):
            raise ValueError(f"enable={self.enable!r}: must be true or false")
        if isinstance(self.rho, bool) or not isinstance(self.rho, (int, float)) or not (0.0 < self.rho <= 1.0):
            raise ValueError(f"rho={self.rho!r}: must be a number in (0, 1]")
        object.__setattr__(self, "rho", float(self.rho))
        if self.scope not in _SCOPES:
            raise ValueError(f"scope={self.scope!r}: must be one of {list(_SCOPES)}")


def load_params(algorithm_config: Any) -> ForkingParams:
    """``ForkingParams`` from verl's ``algorithm`` node (its ``forking`` block; absent = disabled)."""
    node = algorithm_config.get("forking", None) if algorithm_config is not None else None
    return load_knobs(ForkingParams, node, "algorithm.forking")


def _nested_to_padded(x: torch.Tensor, width: int) -> torch.Tensor:
    padded = x.to_padded_tensor(0) if x.is_nested else x
    if padded.shape[1] < width:
        padded = torch.nn.functional.pad(padded, (0, width - padded.shape[1]))
    return padded[:, :width]


def _padded_to_nested_like(padded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Pack ``padded`` ``[b, W]`` into a jagged nested tensor with ``like``'s offsets (row i keeps ``len_i``)."""
    if not like.is_nested:
        return padded[:, : like.shape[1]].to(like.dtype)
    offsets = like.offsets()
    lengths = offsets.diff()
    inside = torch.arange(padded.shape[1], device=padded.device)[None, :] < lengths[:, None].to(padded.device)
    values = padded[inside].to(like.dtype)
    # Without explicit seqlen bounds to_padded_tensor pads to the total length; keep the row lengths' bounds.
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=int(lengths.min()), max_seqlen=int(lengths.max())
    )


class ForkingPPOLoss:
    """Loss callable for ``set_loss_fn``: ``fn(model_output, data, dp_group=None) -> (loss, metrics)``.

    Args:
        actor_config: the actor dataclass (``omega_conf_to_dataclass(config.actor_rollout_ref.actor)``); must use
            ``loss_agg_mode=token-mean``.
        params: :class:`ForkingParams`.
    """

    def __init__(self, actor_config: Any, params: ForkingParams):
        if actor_config.loss_agg_mode != "token-mean":
            raise ValueError(
                f"actor.loss_agg_mode={actor_config.loss_agg_mode!r}: forking tokens need token-mean (the "
                "denominator counts the selected tokens)"
            )
        self.config = actor_config
        self.params = params

    def __call__(self, model_output: dict, data: Any, dp_group: Any = None):
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import AggregationType, Metric
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        from gtpo.verl_plugin.loss_metrics import tag_extrema

        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        width = log_prob.shape[1]
        resp_nested = data["response_mask"]
        valid = _nested_to_padded(resp_nested, width).bool()

        if self.params.scope == "micro_batch":
            ent = model_output.get("entropy", None)
            if ent is None:
                raise ValueError(
                    "algorithm.forking.scope=micro_batch needs the training policy's entropy: set "
                    "actor_rollout_ref.actor.calculate_entropy=true"
                )
            entropy = no_padding_2_padding(ent, data).detach()
            selected, tau = top_entropy_mask(entropy, valid, self.params.rho)
        else:
            tau_b = tu.get_non_tensor_data(data=data, key=THRESHOLD_KEY, default=None)
            frac_b = tu.get_non_tensor_data(data=data, key=FRACTION_KEY, default=None)
            if tau_b is None or frac_b is None or "entropy" not in data.keys():
                raise ValueError(
                    "algorithm.forking.scope=batch needs the driver hook: batch.extra_info from "
                    "gtpo.algorithms.token_selection.batch_threshold_extra_info and the old-policy entropy in the batch"
                )
            entropy = _nested_to_padded(data["entropy"], width).detach()
            selected, tau = top_entropy_mask(entropy, valid, self.params.rho, threshold=float(tau_b))

        n_valid = int(valid.sum())
        n_sel = int(selected.sum())
        total = data["batch_num_tokens"]
        total = float(total.item() if isinstance(total, torch.Tensor) else total)
        if self.params.scope == "micro_batch":
            eff = total * n_sel / n_valid if n_sel > 0 else total
        else:
            eff = total * float(frac_b) if float(frac_b) > 0 else total

        sub = data.copy()
        sub["response_mask"] = _padded_to_nested_like(selected, resp_nested)
        tu.assign_non_tensor(sub, batch_num_tokens=eff)
        outputs = model_output
        if not self.config.entropy_coeff and model_output.get("entropy", None) is not None:
            # No entropy bonus: nothing may backpropagate into the entropy (see the module docstring).
            outputs = {**model_output, "entropy": model_output["entropy"].detach()}
        loss, metrics = ppo_loss(self.config, outputs, sub, dp_group=dp_group)
        tag_extrema(metrics)
        extra = {
            "forking/selected_token_frac": n_sel / max(n_valid, 1),
            "forking/entropy_threshold": float(tau) if torch.isfinite(tau) else 0.0,
        }
        metrics.update(Metric.from_dict(extra, aggregation=AggregationType.MEAN))
        return loss, metrics


def install(trainer: Any) -> ForkingParams | None:
    """Install :class:`ForkingPPOLoss` in every actor worker when ``algorithm.forking.enable``; else, with the grpo_s
    policy loss, :class:`gtpo.verl_plugin.loss_metrics.GRPOSPPOLoss`; else leave verl's loss.

    Call once after ``init_workers`` (the actor worker group exists) and before the first step.

    Returns:
        The parsed params when the forking loss is installed, else None.
    """
    from verl.utils.config import omega_conf_to_dataclass

    from gtpo.verl_plugin.loss_metrics import install_grpo_s_loss

    params = load_params(trainer.config.algorithm)
    if not params.enable:
        install_grpo_s_loss(trainer)
        return None
    actor_config = omega_conf_to_dataclass(trainer.config.actor_rollout_ref.actor)
    if params.scope == "micro_batch" and not actor_config.calculate_entropy:
        raise ValueError(
            "algorithm.forking.scope=micro_batch needs actor_rollout_ref.actor.calculate_entropy=true "
            "(the training policy's entropy selects the tokens)"
        )
    trainer.actor_rollout_wg.set_loss_fn(ForkingPPOLoss(actor_config, params))
    return params
