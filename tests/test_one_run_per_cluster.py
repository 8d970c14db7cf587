"""One verl run per Ray cluster: a driver that joins a cluster where another run's TransferQueue controller lives
stops before its TaskRunner exists, in one line, exit 2 (gtpo.launch.local_ray.refuse_a_cluster_in_use).

    .venv/bin/python -m pytest -q tests/test_one_run_per_cluster.py

verl's ``tq.init`` would attach the second run to the first run's controller and its ``tq.close`` kill it (seam
``one-run-per-cluster``); the end-to-end case (an evaluation started on the Ray cluster of a run that trains) is
tests/test_eval_checkpoint.py, slow tier. Here Ray's lookups are the test's: a controller found and answering, found
and dead (its run ended), or none.
"""

from __future__ import annotations

import pytest
import ray

from gtpo.launch import local_ray
from recipe.gtpo import main_gtpo


class _Controller:
    def __init__(self, answer):
        self.answer = answer
        self.get_config = self

    def remote(self):
        return self.answer


def _cluster(monkeypatch, controller):
    """Ray as the driver sees a cluster holding ``controller`` (None: no controller)."""

    def get_actor(name, namespace=None):
        if controller is None or (name, namespace) != ("TransferQueueController", "transfer_queue"):
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return controller

    def get(ref, timeout=None):
        if isinstance(ref, BaseException):
            raise ref
        return ref

    class _Context:
        gcs_address = "10.0.0.5:6379"

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _Context())


def test_a_cluster_holding_a_live_controller_is_refused_naming_the_way_out(monkeypatch):
    _cluster(monkeypatch, _Controller({"controller": "config"}))
    with pytest.raises(local_ray.ClusterInUseError) as err:
        local_ray.refuse_a_cluster_in_use()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("the Ray cluster at 10.0.0.5:6379 runs another verl job")
    assert "a cluster of its own" in message and "no RAY_ADDRESS" in message


@pytest.mark.parametrize(
    "controller",
    [None, _Controller(ray.exceptions.RayActorError())],
    ids=["no controller", "the controller of an ended run"],
)
def test_a_cluster_without_a_live_controller_is_accepted(monkeypatch, controller):
    _cluster(monkeypatch, controller)
    local_ray.refuse_a_cluster_in_use()


def test_a_controller_too_busy_to_answer_is_still_a_run_in_the_way(monkeypatch):
    _cluster(monkeypatch, _Controller(ray.exceptions.GetTimeoutError()))
    with pytest.raises(local_ray.ClusterInUseError):
        local_ray.refuse_a_cluster_in_use()


def test_the_driver_exits_2_in_one_line_before_its_task_runner_exists(monkeypatch, capsys):
    """run_preemptible through verl's ``run_ppo`` contract: ``task_runner_class.remote()`` right after ``ray.init``."""
    from omegaconf import OmegaConf

    _cluster(monkeypatch, _Controller({"controller": "config"}))
    created = []

    class _TaskRunner:
        def remote(self, *args, **kwargs):
            created.append(args)

    def run_ppo(config, task_runner_class):
        task_runner_class.remote()

    monkeypatch.setattr(main_gtpo, "run_ppo", run_ppo)
    monkeypatch.setattr(ray, "remote", lambda cls: _TaskRunner())
    config = OmegaConf.create({"algorithm": {"preemption": {}}})
    assert main_gtpo.run_preemptible(config) == main_gtpo.CONFIG_ERROR_EXIT
    assert created == []
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("gtpo: the Ray cluster at 10.0.0.5:6379 runs another verl job")


def test_a_driver_on_no_cluster_looks_up_nothing(monkeypatch):
    """Not initialised, ``ray.get_actor`` would start a local Ray of its own just to look."""

    def get_actor(name, namespace=None):
        raise AssertionError("looked up an actor without a cluster")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    local_ray.refuse_a_cluster_in_use()
