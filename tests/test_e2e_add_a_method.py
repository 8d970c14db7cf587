"""docs/architecture.md's "Add a method" followed to the end: a toy method of the test tree trains in verl's trainer.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q tests/test_e2e_add_a_method.py

The method is :mod:`tests.support.toy_method` alone (its estimator, knobs and table row): the run imports it in every
process through ``VERL_USE_EXTERNAL_MODULES`` and selects it with ``algorithm.adv_estimator=toy``; nothing of the
package changes. Two steps of verl's sync trainer with verl's vLLM rollout on the CPU backend: the driver's checks
know the row, the trainer hands it the old policy's entropy it declares, and its metrics come back under ``toy/``.
"""

from __future__ import annotations

import pytest

from tests.support.e2e import assert_ran, base_overrides, run_recipe

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOY_MODULE = "tests.support.toy_method"


def test_a_toy_method_trains_two_steps(ray_cluster, tiny_assets, tmp_path, monkeypatch):
    # the driver imports the row with verl; the entry point carries the module list into the runtime env
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", TOY_MODULE)
    overrides = base_overrides(tiny_assets) + [
        "method=grpo",
        "algorithm.adv_estimator=toy",
        "+algorithm.toy.scale=0.25",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "trainer.total_training_steps=2",
    ]
    result = run_recipe(ray_cluster, tmp_path, overrides, name="toy")
    assert_ran(result, steps=2)
    for entry in result.metrics:
        data = entry["data"]
        # the old policy's entropy reached the estimator (a random model's is far from 0) ...
        assert data["toy/mean_entropy"] > 1.0, data
        # ... which shaped advantages that verl's update consumed
        assert data["toy/adv_abs_mean"] > 0.0 and "actor/pg_loss" in data, data
