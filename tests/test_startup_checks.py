"""Start-up checks of the recipe's trainer (gtpo.trainer.guard.startup_checks): a reward worker whose constructor
raises stops the run with that error. Real Ray actors on the session's cluster; the full trainer case is in
tests/test_demo_presets.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from gtpo.trainer.guard.startup_checks import RewardWorkerStartupError, check_reward_workers


def _trainer(workers):
    config = OmegaConf.create({"reward": {"reward_manager": {"name": "dapo"}}})
    return SimpleNamespace(config=config, reward_loop_manager=SimpleNamespace(reward_loop_workers=workers))


def test_a_trainer_without_reward_workers_passes():
    assert check_reward_workers(SimpleNamespace()) == 0
    assert check_reward_workers(_trainer([])) == 0


class _Worker:
    def __init__(self, fail: bool):
        # the message of verl's DAPO reward manager
        assert not fail, "max_resp_len must be larger than overlong_buffer.len"

    def ping(self):
        return "pong"


@pytest.mark.e2e
def test_a_failed_constructor_is_raised_with_its_message(ray_session):
    ray = ray_session
    actor = ray.remote(num_cpus=0)(_Worker)
    good = [actor.remote(False), actor.remote(False)]
    assert check_reward_workers(_trainer(good), timeout_s=120) == 2
    bad = [actor.remote(False), actor.remote(True)]
    with pytest.raises(RewardWorkerStartupError) as info:
        check_reward_workers(_trainer(bad), timeout_s=120)
    text = str(info.value)
    assert text.startswith("reward worker 1 (reward.reward_manager.name=dapo) failed in its constructor")
    assert "AssertionError: max_resp_len must be larger than overlong_buffer.len" in text
    for handle in good + bad:
        ray.kill(handle)
