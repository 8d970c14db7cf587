"""The driver's exit status (recipe/gtpo/main_gtpo.py ``run_preemptible``): 85 after a preemption save, 75 after the
stage watchdog ended a stalled stage, whether the trainer raised :class:`StageTimeoutError` or its process exited.

    .venv/bin/python -m pytest -q tests/test_driver_exit.py

verl's ``run_ppo`` is replaced by a stand-in that waits on a trainer-like actor, as ``run_ppo`` waits on the
TaskRunner: first with the exceptions built as Ray builds them (no cluster), then on the session's Ray cluster with
an actor that runs the real watchdog (its error through ``ray.get``; its ``os._exit(75)`` after ``grace_s``).
"""

from __future__ import annotations

import os
import signal

import pytest
from omegaconf import OmegaConf

from gtpo.trainer.guard.watchdog import EXIT_CODE as STALLED_EXIT
from gtpo.trainer.guard.watchdog import StageTimeoutError
from gtpo.trainer.preemption.stop import EXIT_CODE as PREEMPTED_EXIT
from gtpo.trainer.preemption.stop import PreemptedError

CONFIG = OmegaConf.create({"algorithm": {}})
MESSAGE = "gtpo watchdog: stage 'generation' made no progress for 31 s, over its limit x=30"


@pytest.fixture
def driver(monkeypatch):
    """``run_preemptible`` with ``run_ppo`` replaced by the test's stand-in; the signal handlers it installs in this
    process are put back afterwards."""
    from recipe.gtpo import main_gtpo

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}

    def run(stand_in) -> int:
        monkeypatch.setattr(main_gtpo, "run_ppo", lambda config, task_runner_class: stand_in())
        return main_gtpo.run_preemptible(CONFIG)

    yield run
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def as_ray_raises(cause: BaseException) -> BaseException:
    """The exception ``ray.get`` raises for an actor method that raised ``cause``."""
    from ray.exceptions import RayTaskError

    return RayTaskError("TaskRunner.run", "Traceback (remote)", cause).as_instanceof_cause()


def raising(err: BaseException):
    def stand_in():
        raise err

    return stand_in


def test_stalled_stage_and_preemption_map_to_their_exits(driver, capsys):
    assert driver(raising(as_ray_raises(StageTimeoutError(MESSAGE)))) == STALLED_EXIT
    assert MESSAGE in capsys.readouterr().err
    assert driver(raising(as_ray_raises(PreemptedError("saved", step=3)))) == PREEMPTED_EXIT
    assert driver(lambda: None) == 0
    # any other failure stays a failure with its traceback (exit 1)
    with pytest.raises(RuntimeError) as info:
        driver(raising(as_ray_raises(RuntimeError("boom"))))
    assert str(info.value.cause) == "boom"


def test_a_dead_trainer_is_a_stall_only_when_the_watchdog_recorded_one(driver, monkeypatch, capsys):
    from ray.exceptions import ActorDiedError

    from recipe.gtpo import main_gtpo

    monkeypatch.setattr(main_gtpo, "_recorded_stall", lambda: None)
    with pytest.raises(ActorDiedError):
        driver(raising(ActorDiedError()))
    monkeypatch.setattr(main_gtpo, "_recorded_stall", lambda: MESSAGE)
    assert driver(raising(ActorDiedError())) == STALLED_EXIT
    assert f"{MESSAGE}; the trainer process exited with status {STALLED_EXIT}" in capsys.readouterr().err


def test_the_watchdog_of_a_trainer_actor_ends_the_driver_with_75(ray_session, driver, capsys):
    """Through ray.get on a real actor: the watchdog's error, then the trainer process's own exit after grace_s
    (what the driver sees then is a dead actor; the watchdog's record in Ray's key-value store says why)."""
    import time

    ray = ray_session
    from ray.experimental import internal_kv

    from gtpo.trainer.preemption.channel import KV_NAMESPACE, current_job_id

    @ray.remote(num_cpus=0, max_restarts=0)
    class Trainer:
        def __init__(self):
            from omegaconf import OmegaConf

            from gtpo.trainer.guard.watchdog import watchdog_of

            class Fake:  # what watchdog_of reads of verl's trainer: its config, and no worker to stop
                config = OmegaConf.create({"algorithm": {"watchdog": {"grace_s": 0.5}}})

            self.watchdog = watchdog_of(Fake())

        def raises(self):
            with self.watchdog.stage("generation", 0.2, "algorithm.watchdog.generation_s"):
                while True:
                    time.sleep(0.05)
                    self.watchdog.check()

        def hangs(self):
            with self.watchdog.stage("generation", 0.2, "algorithm.watchdog.generation_s"):
                time.sleep(120)

        def crashes(self):
            os._exit(1)

    key = f"watchdog/job/{current_job_id()}"
    internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
    try:
        # a trainer that dies without a stall is not one
        with pytest.raises(ray.exceptions.RayActorError):
            driver(lambda: ray.get(Trainer.remote().crashes.remote(), timeout=60))
        assert driver(lambda: ray.get(Trainer.remote().raises.remote(), timeout=60)) == STALLED_EXIT
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
        assert driver(lambda: ray.get(Trainer.remote().hangs.remote(), timeout=60)) == STALLED_EXIT
        err = capsys.readouterr().err
        assert "over its limit algorithm.watchdog.generation_s=0.2; the trainer process exited with status 75" in err
    finally:
        internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)


def test_the_stop_handlers_are_installed_again_when_run_ppo_creates_the_runner(driver, monkeypatch):
    """verl's ``run_ppo`` calls ``ray.init`` (which sets its own SIGTERM handler, exiting the driver at once) and
    then creates the TaskRunner from ``task_runner_class``: from then on SIGTERM and SIGUSR1 are the relay's again."""
    from recipe.gtpo import main_gtpo

    seen = {}

    class ActorClass:  # what ray.remote(GTPOTaskRunner) offers run_ppo: options(...) and remote()
        def __init__(self, options=None):
            self.given = options

        def options(self, **kwargs):
            return ActorClass(kwargs)

        def remote(self):
            seen["options"] = self.given
            return "runner"

    def run_ppo(config, task_runner_class):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            seen[f"{sig.name} before ray.init"] = getattr(signal.getsignal(sig), "__self__", None)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as ray.init does
        runner = task_runner_class.options(runtime_env={"nsight": {}}).remote()
        seen["runner"] = runner
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            seen[sig.name] = getattr(signal.getsignal(sig), "__self__", None)

    monkeypatch.setattr(main_gtpo.ray, "remote", lambda cls: ActorClass())
    monkeypatch.setattr(main_gtpo, "run_ppo", run_ppo)
    assert main_gtpo.run_preemptible(CONFIG) == 0
    relay = seen["SIGTERM"]
    assert isinstance(relay, main_gtpo.DriverRelay)
    assert seen["SIGUSR1"] is relay and seen["SIGTERM before ray.init"] is relay
    assert seen["runner"] == "runner" and seen["options"] == {"runtime_env": {"nsight": {}}}
