"""The plugin's registrations reach verl's registries, in the driver and in every Ray worker process.

    .venv/bin/python -m pytest -q tests/test_registration.py

The Ray part is the negative control the registration design rests on: a loss registered only in the driver is
unknown in a worker, and the recipe's own losses are found there only through ``VERL_USE_EXTERNAL_MODULES`` or the
``verl.plugins`` entry point.
"""

from __future__ import annotations

import importlib

import pytest


def test_registry_round_trip():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    register = importlib.import_module("gtpo.verl_plugin.register")
    from gtpo.methods import METHODS
    from gtpo.trainer import modes as trainer

    gtpo = get_adv_estimator_fn("gtpo")
    for name in ("gtpo", "grpo_s", "gtpo_traj"):
        assert get_adv_estimator_fn(name).method is METHODS[name]
    assert callable(get_policy_loss_fn("grpo_s"))
    assert get_trainer_cls("gtpo_sync") is trainer.GTPOTrainerSync
    assert get_trainer_cls("gtpo_colocate_async") is trainer.GTPOTrainerColocateAsync
    assert get_trainer_cls("gtpo_separate_async") is trainer.GTPOTrainerSeparateAsync
    assert set(register.TRAINER_MODES) == {"gtpo_sync", "gtpo_colocate_async", "gtpo_separate_async"}
    assert set(register.ESTIMATORS) == {"gtpo", "grpo_s", "gtpo_traj"}

    # Importing again registers nothing new and raises nothing.
    importlib.reload(importlib.import_module("gtpo.verl_plugin.register"))
    assert get_adv_estimator_fn("gtpo") is gtpo


def test_name_clash_is_rejected():
    from verl.trainer.ppo.core_algos import register_adv_est

    import gtpo.verl_plugin.register  # noqa: F401

    with pytest.raises(ValueError):

        @register_adv_est("gtpo")
        def _impostor(**kwargs):  # pragma: no cover - never called
            raise AssertionError


def _probe_registries(names):
    """Runs in a Ray worker: which loss modes, estimators and trainer modes does verl know after ``import verl``?"""
    import verl  # noqa: F401  (runs verl's plugin hooks)
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    found = {}
    for kind, lookup in (
        ("loss", get_policy_loss_fn),
        ("estimator", get_adv_estimator_fn),
        ("trainer", get_trainer_cls),
    ):
        for name in names[kind]:
            try:
                lookup(name)
                found[f"{kind}:{name}"] = True
            except (ValueError, KeyError):
                found[f"{kind}:{name}"] = False
    return found


@pytest.mark.parametrize(
    ("env", "expect_recipe_loss"),
    [
        ({"VERL_USE_EXTERNAL_MODULES": "gtpo.verl_plugin.register", "VERL_USE_EXTERNAL_PLUGINS": "none"}, True),
        ({"VERL_USE_EXTERNAL_MODULES": "", "VERL_USE_EXTERNAL_PLUGINS": "auto"}, True),
        ({"VERL_USE_EXTERNAL_MODULES": "", "VERL_USE_EXTERNAL_PLUGINS": "none"}, False),
    ],
    ids=["external-modules", "entry-point", "neither-hook"],
)
def test_registration_reaches_ray_workers(ray_session, env, expect_recipe_loss):
    from verl.trainer.ppo.core_algos import register_policy_loss

    @register_policy_loss("gtpo_test_driver_only")
    def _driver_only(**kwargs):  # pragma: no cover - never called
        raise AssertionError

    ray = ray_session
    # A stock worker environment: the session cluster's CPU platform selection is not part of this question.
    env = {**env, "VERL_PLATFORM": ""}
    probe = ray.remote(num_cpus=0)(_probe_registries).options(runtime_env={"env_vars": env})
    names = {
        "loss": ["grpo_s", "gtpo_test_driver_only", "vanilla"],
        "estimator": ["gtpo", "grpo_s", "gtpo_traj", "grpo"],
        "trainer": ["gtpo_sync", "gtpo_colocate_async", "gtpo_separate_async", "sync"],
    }
    found = ray.get(probe.remote(names), timeout=180)

    assert found["loss:vanilla"] and found["estimator:grpo"] and found["trainer:sync"], "verl's own entries"
    assert not found["loss:gtpo_test_driver_only"], "a loss registered only in the driver must not exist in a worker"
    recipe = ["loss:grpo_s", "estimator:gtpo", "estimator:grpo_s", "estimator:gtpo_traj", "trainer:gtpo_sync"]
    recipe += ["trainer:gtpo_colocate_async", "trainer:gtpo_separate_async"]
    assert {key: found[key] for key in recipe} == dict.fromkeys(recipe, expect_recipe_loss)
