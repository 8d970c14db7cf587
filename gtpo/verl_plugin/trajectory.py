"""verl adapter of GTPO-trajectory (arXiv 2508.03772): the ``gtpo_traj`` advantage estimator.

Registered with ``verl.trainer.ppo.core_algos.register_adv_est("gtpo_traj")``; the math lives in
``gtpo.algorithms.trajectory``. Knobs: ``algorithm.gtpo_traj.*`` (``GTPOTrajParams``).

Mapping onto verl's loss (docs/ALGORITHMS.md §6.6):

- The conflict weights, the entropy filter, the entropy penalty and the ``1/n_conf`` factor all fold into the
  token-level advantages; the policy loss is verl's ``vanilla`` PPO-clip loss with
  ``actor.loss_agg_mode=seq-mean-token-mean`` (per completion ``1/|o_i|``, then the mean over the completions of
  the mini-batch = the README's ``1/G`` per prompt, averaged over prompts) and ``actor.ppo_epochs=1``. With one
  mini-batch per rollout step the ratio is ``exp(0) = 1`` and the clip is inactive, i.e. the paper's on-policy
  objective. ``agg=code_sum`` (the official code's sum over the G completions of its one-prompt step) multiplies
  each completion's advantage by its group's size, which turns verl's batch mean into the mean over prompts of
  per-prompt sums.
- ``lambda_neg = 0`` zeroes the advantage of a negative completion's conflict tokens; it does not mask them. Under
  ``seq-mean-token-mean`` those tokens still count in the completion's ``|o_i|`` denominator, which is exactly the
  official code (it divides by the full completion length). Under ``token-mean`` the tokens would still count in
  the batch token denominator as well; either way their gradient is exactly 0 and the other tokens' gradients are
  scaled as if they were present. ``tests/test_trajectory.py`` checks both statements through verl's loss.

``<H>_ini`` (ini gate, ``variant=paper``): if ``algorithm.gtpo_traj.h_ini`` is null, the first call of the
estimator in a run measures it (mean over that batch's completions of ``<H>_i``) and writes it into the ``state``
the trainer passes (``state["h_ini"]``, its ``gtpo_traj`` block of the recipe state), where later calls read it;
every step logs it as ``gtpo_traj/h_ini``. The trainer keeps that state, saves it with each checkpoint and restores
it on resume (``gtpo.trainer.checkpoint_state``), so two trainers in one process never share a value. A call
without ``state`` measures on its own batch and keeps nothing. A resumed run (``global_steps > 1``) that still has
no value (a checkpoint without the recipe's state file) raises and asks for ``algorithm.gtpo_traj.h_ini`` rather
than measuring a trained policy's entropy as the "initial" one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gtpo.algorithms.group_ops import group_ids
from gtpo.algorithms.kernel_dispatch import row_sums
from gtpo.algorithms.trajectory import gtpo_traj_advantages
from gtpo.algorithms.trajectory_params import GTPOTrajParams
from gtpo.knobs import load_knobs

__all__ = ["compute_gtpo_traj_advantage", "load_params"]

_CONFIG_KEY = "gtpo_traj"


def load_params(config: Any) -> GTPOTrajParams:
    """``GTPOTrajParams`` from the ``algorithm`` node (reads its ``gtpo_traj`` block; absent = defaults)."""
    node = config.get(_CONFIG_KEY, None) if config is not None else None
    return load_knobs(GTPOTrajParams, node, f"algorithm.{_CONFIG_KEY}")


def _register(fn):
    try:
        from verl.trainer.ppo.core_algos import register_adv_est
    except ImportError:  # pragma: no cover - verl is a dependency of the adapter layer
        return fn
    return register_adv_est("gtpo_traj")(fn)


@_register
def compute_gtpo_traj_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    entropy: torch.Tensor | None = None,
    responses: torch.Tensor | None = None,
    metrics: dict | None = None,
    state: dict | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GTPO-trajectory advantages in verl's estimator contract.

    Args:
        token_level_rewards: ``[B, L]``; the sequence reward is its row sum.
        response_mask: ``[B, L]`` 0/1.
        index: ``[B]`` uids (np object array); rows grouped strictly by uid, any order, any group sizes.
        config: verl's ``algorithm`` node (``config.get("gtpo_traj")``).
        entropy: ``[B, L]`` per-token entropy of the old policy (verl's old-log-prob recompute). Required.
        responses: ``[B, L]`` int64 response token ids. Required (conflict tokens compare token ids).
        metrics: optional dict; receives ``gtpo_traj/...`` python floats.
        state: the trainer's ``gtpo_traj`` state (a dict it checkpoints): ``state["h_ini"]`` is the measured
            ``<H>_ini``, read here and written by the call that measures it. None: measured on this batch, kept
            nowhere.
        **kwargs: ``global_steps`` (optional int) enables the resume check of the ini gate; others ignored.

    Returns:
        ``(advantages, returns)``, both ``[B, L]`` float32, equal, zero on padding.
    """
    if entropy is None:
        raise ValueError(
            "gtpo_traj needs the per-token entropy (entropy=None): run it with one of the recipe's trainers "
            "(trainer.v1.trainer_mode=gtpo_sync, gtpo_colocate_async or gtpo_separate_async) and without "
            "algorithm.rollout_correction.bypass_mode (bypass mode computes no entropy)"
        )
    if responses is None:
        raise ValueError(
            "gtpo_traj needs the response token ids (responses=None) to find conflict tokens: run it with one of "
            "the recipe's trainers (trainer.v1.trainer_mode=gtpo_sync, gtpo_colocate_async or gtpo_separate_async)"
        )
    if index is None:
        raise ValueError("gtpo_traj needs index (the uid of each row) to form groups; got index=None")
    if token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} != response_mask {tuple(response_mask.shape)}"
        )
    for name, t in (("entropy", entropy), ("responses", responses)):
        if tuple(t.shape) != tuple(response_mask.shape):
            raise ValueError(f"{name} shape {tuple(t.shape)} != response_mask shape {tuple(response_mask.shape)}")
    params = load_params(config)

    device = token_level_rewards.device
    mask = response_mask.to(device)
    gid, num_groups = group_ids(index)
    gid = gid.to(device)
    # the sequence reward, as verl's GRPO takes it (verl's token-level rewards are 0 off the response)
    scores = row_sums(token_level_rewards)

    h_ini = params.h_ini
    measure = False
    if params.use_ini_gate and h_ini is None:
        h_ini = state.get("h_ini") if state is not None else None
        if h_ini is None:
            step = kwargs.get("global_steps")
            if step is not None and int(step) > 1:
                raise ValueError(
                    f"algorithm.gtpo_traj.h_ini=null on a resumed run (global_steps={int(step)}) whose checkpoint "
                    "holds no measured value (no gtpo_state.json): the ini gate needs the initial model's entropy; "
                    "set algorithm.gtpo_traj.h_ini to the gtpo_traj/h_ini value logged at step 1 "
                    "(or use_ini_gate=false)"
                )
            measure = True

    out = gtpo_traj_advantages(
        scores=scores,
        response_mask=mask,
        responses=responses.to(device),
        entropy=entropy.to(device).detach(),
        gid=gid,
        num_groups=num_groups,
        params=params,
        h_ini=h_ini,
        measure_h_ini=measure,
    )
    if measure and state is not None:
        state["h_ini"] = float(out.h_ini)
    if metrics is not None:
        metrics.update(out.metrics)
    advantages = out.advantages.to(token_level_rewards.dtype)
    return advantages, advantages  # the same tensor, as verl's GRPO estimators return it
