"""Groups short of ``rollout.n`` responses (failed rollout sessions): logged by every recipe estimator call, or
refused with ``algorithm.groups.refuse_short``.

    .venv/bin/python -m pytest -q tests/test_group_sizes.py
"""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from gtpo.knobs import GroupParams
from gtpo.trainer.group_sizes import ShortGroupError, group_size_metrics
from tests.support.v1_trainers import compute_advantages, make_trainer, tq_batch


def test_metrics_count_the_groups_short_of_n():
    index = np.array(["a"] * 4 + ["b"] * 3 + ["c"] * 4 + ["d"] * 1, dtype=object)
    assert group_size_metrics(index, 4, "gtpo") == {"gtpo/min_group_size": 1.0, "gtpo/short_groups_total": 2.0}
    full = np.array(["x", "y", "x", "y"], dtype=object)
    assert group_size_metrics(full, 2, "grpo_s") == {"grpo_s/min_group_size": 2.0, "grpo_s/short_groups_total": 0.0}


def test_refusal_names_the_short_groups_and_the_way_out():
    index = np.array(["a"] * 4 + ["b"] * 3, dtype=object)
    with pytest.raises(ShortGroupError, match=r"1 of 2 groups .* rollout.n=4 .*b \(3\).*refuse_short=false"):
        group_size_metrics(index, 4, "gtpo", refuse_short=True)
    # whole groups pass the refusal
    assert group_size_metrics(index[:4], 4, "gtpo", refuse_short=True)["gtpo/short_groups_total"] == 0.0


def test_no_responses_per_group_is_refused_and_an_empty_batch_logs_zeros():
    with pytest.raises(ValueError, match=r"expected=0: responses per group must be >= 1"):
        group_size_metrics(np.array(["a", "a"], dtype=object), 0, "gtpo")
    empty = np.array([], dtype=object)
    assert group_size_metrics(empty, 4, "gtpo") == {"gtpo/min_group_size": 0.0, "gtpo/short_groups_total": 0.0}
    assert group_size_metrics(empty, 4, "gtpo", refuse_short=True)["gtpo/short_groups_total"] == 0.0


def test_bad_knob_values_are_refused_with_the_key():
    from gtpo.methods import knob

    with pytest.raises(ValueError, match=r"algorithm.groups.refuse_short"):
        knob(OmegaConf.create({"groups": {"refuse_short": "yes"}}), "groups")
    with pytest.raises(ValueError, match=r"algorithm.groups"):
        knob(OmegaConf.create({"groups": {"refuse_shrt": True}}), "groups")
    assert knob(OmegaConf.create({}), "groups") == GroupParams(refuse_short=False)


@pytest.mark.parametrize("method", ["gtpo", "grpo_s", "gtpo_traj"])
def test_the_trainer_logs_a_group_left_with_three_of_four(method, monkeypatch):
    rows, meta = tq_batch()  # three groups of four
    del rows["k5"]  # group b lost one response to a failed session
    meta.keys.remove("k5")
    meta.tags.pop()
    overrides = [f"method={method}", "actor_rollout_ref.rollout.n=4", "algorithm.gtpo_traj.h_ini=1.0"]
    _, metrics = compute_advantages(make_trainer("gtpo_sync", overrides), monkeypatch, rows, meta)
    assert metrics[f"{method}/min_group_size"] == 3.0 and metrics[f"{method}/short_groups_total"] == 1.0
    assert metrics[f"{method}/estimator_rows"] == 11.0

    refusing = make_trainer("gtpo_sync", [*overrides, "algorithm.groups.refuse_short=true"])
    with pytest.raises(ShortGroupError, match=r"1 of 3 groups"):
        compute_advantages(refusing, monkeypatch, rows, meta)


def test_whole_groups_log_no_short_group(monkeypatch):
    rows, meta = tq_batch()
    trainer = make_trainer("gtpo_sync", ["method=gtpo", "actor_rollout_ref.rollout.n=4"])
    _, metrics = compute_advantages(trainer, monkeypatch, rows, meta)
    assert metrics["gtpo/min_group_size"] == 4.0 and metrics["gtpo/short_groups_total"] == 0.0


def test_verl_combines_the_slices_of_a_separate_async_step_as_counts():
    """verl's MetricsAggregator picks the reduction by metric name: the short groups of the step's slices add up, the
    smallest group is the smallest of any slice (an averaged count would read 1.5 here)."""
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    slices = [np.array(["a"] * 4 + ["b"] * 3 + ["c"] * 2), np.array(["d"] * 4 + ["e"] * 3)]
    aggregator = MetricsAggregator()
    for index in slices:
        aggregator.add_step_metrics(group_size_metrics(index, 4, "gtpo"), sample_count=len(index))
    step = aggregator.get_aggregated_metrics()
    assert step["gtpo/short_groups_total"] == 3.0 and step["gtpo/min_group_size"] == 2.0
