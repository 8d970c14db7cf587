"""Loss-side extremes through verl's own metric aggregation: ``grpo_s/seq_ratio_min|max`` come out as the min / max
over micro-batches and data-parallel ranks, not as a mean of per-micro-batch extremes.

    .venv/bin/pytest -q tests/test_loss_metrics.py

Each micro-batch goes through the loss a worker calls (verl's ``ppo_loss`` with the grpo_s policy loss, wrapped by
the recipe's :class:`ExtremaPPOLoss` or :class:`ForkingPPOLoss`); its metrics then take verl's path: one rank's
micro-batches are merged by ``postprocess_batch_func``, the ranks by ``Metric.aggregate_dp`` (the actor worker's
``update_actor``), the mini-batches by ``reduce_metrics`` (the driver).
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from tests.support.forking import actor_config, forking_params, micro_batch

# Two micro-batches of two responses each, with log-probs 0: a response whose old log-probs are all -log(r) has
# sequence ratio r. Extremes per micro-batch: (0.5, 1.0) and (1.2, 1.5); over both: 0.5 and 1.5.
RATIOS = ([0.5, 1.0], [1.2, 1.5])


def _grpo_s_metrics(loss_fn, ratios: list[float]) -> dict:
    n = len(ratios)
    data, out, *_ = micro_batch([2] * n, [[0.5, 0.6, 0.7]] * n, [[1.0, 1.0, 1.0]] * n)
    data["old_log_probs"] = torch.nested.as_nested_tensor(
        [torch.full((3,), -math.log(r)) for r in ratios], layout=torch.jagged
    )
    _, metrics = loss_fn(model_output=out, data=data)  # as verl's engine calls it
    return metrics


def _rank_metrics(per_micro_batch: list[dict]) -> dict:
    """One rank's metrics of a mini-batch, merged across its micro-batches as verl's engine does."""
    from tensordict import TensorDict
    from verl.workers.engine.utils import postprocess_batch_func

    outputs = [{"metrics": m} for m in per_micro_batch]
    return postprocess_batch_func(output_lst=outputs, indices=None, data=TensorDict({}, batch_size=[]))["metrics"]


def _update_actor(ranks: list[dict], key: str) -> float:
    """The worker's aggregation over DP ranks (verl/workers/engine_workers.py, update_actor)."""
    from verl.utils.metric import Metric

    return float(Metric.aggregate_dp([rank[key] for rank in ranks]))


def _grpo_s_loss():
    from verl.workers.utils.losses import ppo_loss

    from gtpo.verl_plugin.actor_loss import ExtremaPPOLoss

    config = actor_config("seq-mean-token-mean", loss_mode="grpo_s")
    return ExtremaPPOLoss(config), partial(ppo_loss, config=config)


def test_verl_refuses_a_metric_object_from_a_registered_loss():
    """Why the recipe re-tags after ppo_loss: verl's ppo_loss wraps each policy-loss metric with Metric.from_dict(...,
    MEAN), which raises on a Metric of another aggregation instead of keeping it."""
    from verl.utils.metric import AggregationType, Metric

    with pytest.raises(ValueError, match="Aggregation type mismatch"):
        Metric.from_dict({"grpo_s/seq_ratio_min": Metric(AggregationType.MIN, 0.5)}, aggregation=AggregationType.MEAN)


@pytest.mark.parametrize("layout", ["two micro-batches on one rank", "one micro-batch on each of two ranks"])
def test_grpo_s_extremes_aggregate_to_min_and_max(layout):
    recipe_loss, verl_loss = _grpo_s_loss()

    def aggregate(loss_fn, key):
        per_mb = [_grpo_s_metrics(loss_fn, ratios) for ratios in RATIOS]
        ranks = [_rank_metrics(per_mb)] if layout.startswith("two micro") else [_rank_metrics([m]) for m in per_mb]
        return _update_actor(ranks, key)

    assert aggregate(recipe_loss, "grpo_s/seq_ratio_min") == pytest.approx(0.5)
    assert aggregate(recipe_loss, "grpo_s/seq_ratio_max") == pytest.approx(1.5)
    # The mean stays a mean: (0.75 + 1.35) / 2.
    assert aggregate(recipe_loss, "grpo_s/seq_ratio_mean") == pytest.approx(1.05)
    # verl's loss alone averages the micro-batch extremes.
    assert aggregate(verl_loss, "grpo_s/seq_ratio_min") == pytest.approx((0.5 + 1.2) / 2)
    assert aggregate(verl_loss, "grpo_s/seq_ratio_max") == pytest.approx((1.0 + 1.5) / 2)


def test_the_recipe_loss_changes_nothing_but_the_aggregation():
    recipe_loss, verl_loss = _grpo_s_loss()
    ours, theirs = (_grpo_s_metrics(fn, RATIOS[0]) for fn in (recipe_loss, verl_loss))
    assert set(ours) == set(theirs)
    for key in ours:
        assert getattr(ours[key], "values", ours[key]) == getattr(theirs[key], "values", theirs[key]), key
    assert ours["grpo_s/seq_ratio_min"].aggregation.value == "min"
    assert ours["grpo_s/seq_ratio_max"].aggregation.value == "max"
    assert ours["grpo_s/seq_clipfrac"].aggregation.value == theirs["grpo_s/seq_clipfrac"].aggregation.value == "mean"


def test_forking_with_the_grpo_s_loss_keeps_the_extremes_too():
    from gtpo.verl_plugin.actor_loss import ForkingPPOLoss

    loss = ForkingPPOLoss(actor_config("token-mean", loss_mode="grpo_s"), forking_params(rho=1.0))
    ranks = [_rank_metrics([_grpo_s_metrics(loss, ratios)]) for ratios in RATIOS]
    assert _update_actor(ranks, "grpo_s/seq_ratio_min") == pytest.approx(0.5)
    assert _update_actor(ranks, "grpo_s/seq_ratio_max") == pytest.approx(1.5)
    assert _update_actor(ranks, "forking/selected_token_frac") == pytest.approx(1.0)


def test_driver_reduces_mini_batches_by_name():
    """After the worker, each key holds one value per mini-batch; verl's driver takes min / max by the key's name."""
    from verl.utils.metric import reduce_metrics

    reduced = reduce_metrics({"actor/grpo_s/seq_ratio_min": [0.5, 0.9], "actor/grpo_s/seq_ratio_max": [1.5, 1.1]})
    assert reduced == {"actor/grpo_s/seq_ratio_min": 0.5, "actor/grpo_s/seq_ratio_max": 1.5}
