"""Preemption's decisions, without Ray: the knobs, the deadline's sources, the step/save arithmetic, and where in
verl's step loop a stop request saves and ends the run (a stand-in trainer driven through verl 0.9.1's hook order).

The real trainer's paths: tests/test_e2e_separate_async.py (SIGTERM to the driver, twice), tests/test_e2e_vllm.py
(SIGUSR1 under colocate_async), tests/test_slurm_preemption.py (a real Slurm: deadline, requeue, resume).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from gtpo.knobs import PreemptionParams, load_knobs, parse_deadline
from gtpo.trainer.preemption.driver import DriverRelay
from gtpo.trainer.preemption.stop import EXIT_CODE, PreemptedError, StopPolicy, TrainerStop, resolve_deadline

# --------------------------------------------------------------------------------------------------------- knobs


@pytest.mark.parametrize(
    "node,message",
    [
        ({"signals": ["SIGUSR9"]}, "algorithm.preemption.signals=['SIGUSR9']: 'SIGUSR9' is not a signal"),
        ({"signals": ["SIGKILL"]}, "'SIGKILL' is not a signal the driver can handle"),
        ({"signals": ["SIGINT"]}, "'SIGINT' is not a signal the driver can handle"),
        ({"deadline": "tomorrow"}, "algorithm.preemption.deadline='tomorrow': expected auto, none, a Unix time"),
        ({"deadline": -5}, "algorithm.preemption.deadline=-5: a Unix time must be > 0"),
        ({"deadline": "0"}, "algorithm.preemption.deadline='0': a Unix time must be > 0"),
        ({"step_factor": 0.5}, "algorithm.preemption.step_factor=0.5: must be a number >= 1"),
        ({"step_factor": "x"}, "algorithm.preemption.step_factor='x': must be a number >= 1"),
        ({"margin_s": -1}, "algorithm.preemption.margin_s=-1: must be a number of seconds >= 0"),
        ({"save_estimate_s": "long"}, "algorithm.preemption.save_estimate_s='long'"),
        ({"deadline_s": 5}, "unknown key(s) algorithm.preemption.deadline_s"),
    ],
)
def test_bad_knobs_are_refused_naming_the_key_and_value(node, message):
    with pytest.raises(ValueError) as err:
        load_knobs(PreemptionParams, node, "algorithm.preemption")
    assert message in str(err.value)


def test_the_recipe_yaml_declares_the_defaults():
    from omegaconf import OmegaConf

    from tests.conftest import REPO_ROOT

    cfg = OmegaConf.load(REPO_ROOT / "recipe" / "gtpo" / "config" / "gtpo_trainer.yaml")
    params = load_knobs(PreemptionParams, cfg.algorithm.preemption, "algorithm.preemption")
    assert params == PreemptionParams()
    assert params.signals == ("SIGUSR1", "SIGTERM") and params.deadline == "auto"


def test_deadline_values():
    assert parse_deadline("auto") == "auto"
    assert parse_deadline(None) is None and parse_deadline("none") is None
    assert parse_deadline(1_800_000_000) == 1_800_000_000.0
    assert parse_deadline("1800000000") == 1_800_000_000.0
    assert parse_deadline("2027-01-15T08:00:00+00:00") == 1_800_000_000.0


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_deadline_is_refused(value):
    """``deadline: true`` in YAML is a bool (an int to Python): taken as a Unix time it would be 1970, a stop after
    the first step."""
    with pytest.raises(ValueError, match=f"deadline={value}: expected auto, none, a Unix time or an ISO 8601 time"):
        parse_deadline(value)
    with pytest.raises(ValueError, match=f"deadline={value}"):
        PreemptionParams(deadline=value)


@pytest.mark.parametrize("value", [0, 0.0, "0", " 0 ", "-1", "nan", "1970-01-01T00:00:00+00:00"])
def test_a_zero_deadline_is_refused_not_taken_as_now(value):
    # a deadline of 0 would stop the run after its first step; `none` is how to turn the deadline off
    with pytest.raises(ValueError, match="a Unix time must be > 0"):
        parse_deadline(value)


# ------------------------------------------------------------------------------------------ where the end comes from


def _squeue(stdout: str, returncode: int = 0):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, stdout=stdout, stderr="")

    return run, calls


def test_auto_reads_squeue_first_then_the_variable():
    run, calls = _squeue("2027-01-15T08:00:00\n")
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_END_TIME": "1700000000"}
    end, source = resolve_deadline(PreemptionParams(), env=env, run=run)
    assert calls == [["squeue", "-h", "-j", "77", "-o", "%e"]]
    assert end == pytest.approx(__import__("datetime").datetime(2027, 1, 15, 8).timestamp())
    assert source == "squeue -j 77 -o %e"
    # squeue unavailable or unknowing (a container without the Slurm client): the job's variable
    for stdout, rc in (("", 1), ("N/A\n", 0), ("garbage\n", 0)):
        run, _ = _squeue(stdout, rc)
        assert resolve_deadline(PreemptionParams(), env=env, run=run) == (1_700_000_000.0, "SLURM_JOB_END_TIME")

    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    assert resolve_deadline(PreemptionParams(), env=env, run=missing)[1] == "SLURM_JOB_END_TIME"
    assert resolve_deadline(PreemptionParams(), env={}, run=missing) == (None, "none")


def test_a_zero_job_end_time_means_no_deadline():
    def missing(cmd, **kwargs):
        raise FileNotFoundError(cmd[0])

    for env in ({"SLURM_JOB_END_TIME": "0"}, {"SLURM_JOB_ID": "77", "SLURM_JOB_END_TIME": "0"}):
        assert resolve_deadline(PreemptionParams(), env=env, run=missing) == (None, "none")
    assert resolve_deadline(PreemptionParams(), env={"SLURM_JOB_END_TIME": "1700000000"}, run=missing) == (
        1_700_000_000.0,
        "SLURM_JOB_END_TIME",
    )


def test_squeue_printing_two_lines_gives_the_first_lines_time():
    # e.g. a heterogeneous job: one line per component, the first of them the job's own
    run, _ = _squeue("2027-01-15T08:00:00\n2027-01-16T09:30:00\n")
    end, source = resolve_deadline(PreemptionParams(), env={"SLURM_JOB_ID": "77"}, run=run)
    assert end == pytest.approx(__import__("datetime").datetime(2027, 1, 15, 8).timestamp())
    assert source == "squeue -j 77 -o %e"


def test_a_knob_deadline_wins_and_none_turns_it_off():
    run, calls = _squeue("2027-01-15T08:00:00\n")
    env = {"SLURM_JOB_ID": "77"}
    assert resolve_deadline(PreemptionParams(deadline=1_800_000_000), env=env, run=run) == (
        1_800_000_000.0,
        "algorithm.preemption.deadline",
    )
    assert resolve_deadline(PreemptionParams(deadline="none"), env=env, run=run) == (None, "none")
    assert calls == []


# ------------------------------------------------------------------------------------------ the step/save arithmetic


def test_stop_policy_by_hand():
    policy = StopPolicy(margin_s=60.0, save_estimate_s=300.0, step_factor=1.0)
    policy.step_started(1000.0)
    policy.step_ended(1010.0)  # a 10 s step
    # before any save: 10 + 300 (estimate) + 60 = 370 s needed
    assert policy.needed_s() == 370.0
    assert policy.out_of_time(1010.0, deadline=1010.0 + 370.0) is None
    reason = policy.out_of_time(1010.0, deadline=1010.0 + 369.0)
    assert reason.startswith("369 s left before the job's end") and "save_estimate_s" in reason
    policy.saved(30.0)  # a timed save replaces the estimate
    policy.step_ended(1065.0)  # 55 s since the last step's end, less the save: a 25 s step (validation, logging in)
    assert policy.needed_s() == 25.0 + 30.0 + 60.0
    policy.step_ended(1070.0)  # a shorter one does not lower it
    policy.saved(10.0)
    assert policy.needed_s() == 115.0
    assert policy.out_of_time(1070.0, deadline=None) is None


def _clocked_stop(now: list[float]) -> TrainerStop:
    """A stop without a deadline or requests, on the fake clock ``now[0]``."""
    return TrainerStop(
        PreemptionParams(deadline="none"),
        job_id="job",
        clock=lambda: now[0],
        requests=lambda: None,
        announce=lambda message: None,
    )


def test_the_time_between_steps_counts_as_step_time(tmp_path):
    policy = StopPolicy(margin_s=0.0, save_estimate_s=0.0, step_factor=1.0)
    policy.step_ended(10.0)
    policy.step_started(30.0)  # 20 s of validation and logging after the step that ended at 10
    policy.step_ended(40.0)
    assert policy.longest_step_s == 30.0
    # the same through the hooks: 10 s steps, 20 s validations
    now = [0.0]
    stop = _clocked_stop(now)
    trainer = StandInTrainer(stop, 3, tmp_path)

    def advance(seconds):
        def callback(step):
            now[0] += seconds

        return callback

    trainer.fit(on_step=advance(10.0), on_validate=advance(20.0))
    assert stop.policy.longest_step_s == 30.0


def test_a_periodic_save_counts_once_as_the_save_not_in_the_step():
    policy = StopPolicy(margin_s=60.0, save_estimate_s=300.0, step_factor=1.5)
    policy.step_started(0.0)
    policy.step_ended(40.0)
    policy.saved(100.0)  # the next step's periodic save
    policy.step_ended(40.0 + 40.0 + 100.0)
    assert policy.longest_step_s == 40.0 and policy.longest_save_s == 100.0
    assert policy.needed_s() == 1.5 * 40.0 + 100.0 + 60.0


def test_step_factor_pads_the_longest_step():
    # dynamic sampling can make the next step several times the longest seen: it is padded by step_factor
    policy = StopPolicy(margin_s=60.0, save_estimate_s=300.0, step_factor=1.5)
    policy.step_started(0.0)
    policy.step_ended(100.0)
    assert policy.needed_s() == 150.0 + 300.0 + 60.0
    assert policy.out_of_time(100.0, deadline=100.0 + 510.0) is None
    reason = policy.out_of_time(100.0, deadline=100.0 + 509.0)
    assert reason == (
        "509 s left before the job's end, less than a step (100 s × step_factor 1.5) + a save (300 s, "
        "save_estimate_s) + margin_s (60 s) = 510 s"
    )
    assert TrainerStop(PreemptionParams(), job_id="job").policy.step_factor == 1.5


# ----------------------------------------------------------------------- the hooks, in verl 0.9.1's order (fit())


class StandInTrainer:
    """What TrainerStop reads and calls on verl's trainer; ``_save_checkpoint`` as StopHooks' (timed, recorded)."""

    def __init__(self, stop: TrainerStop, total: int, tmp_path, save_freq: int = -1):
        self.config = SimpleNamespace(trainer=SimpleNamespace(default_local_dir=str(tmp_path)))
        self.global_steps = 0
        self.total_training_steps = total
        self.save_freq = save_freq
        self.stop = stop
        self.saves: list[int] = []
        self.validations: list[int] = []
        self.logged: list[int] = []
        self.finished = 0
        self.logger = SimpleNamespace(finish=self._finish)

    def _finish(self):
        self.finished += 1

    def _save_checkpoint(self):
        with self.stop.timed_save(self):
            self.saves.append(self.global_steps)

    def fit(self, on_step=None, on_validate=None, on_save=None):
        """verl's loop: step, periodic save, on_step_end, validation, log; the callbacks play the outside world."""
        self.global_steps = 1
        while self.global_steps <= self.total_training_steps:
            self.stop.before_step(self)
            if on_step:
                on_step(self.global_steps)
            if self.save_freq > 0 and self.global_steps % self.save_freq == 0:
                if on_save:
                    on_save(self.global_steps)
                self._save_checkpoint()
            self.stop.after_step(self)
            if not self.stop.skip_validation():
                self.validations.append(self.global_steps)
                if on_validate:
                    on_validate(self.global_steps)
            self.logged.append(self.global_steps)
            self.global_steps += 1


class Requests:
    """A stop request that appears when the test says so."""

    def __init__(self):
        self.reason = None

    def __call__(self):
        return self.reason


def _run(tmp_path, total=6, save_freq=-1, **when):
    requests = Requests()
    announced = []
    stop = TrainerStop(PreemptionParams(deadline="none"), job_id="job", requests=requests, announce=announced.append)
    trainer = StandInTrainer(stop, total, tmp_path, save_freq)
    trainer.announced = announced

    def at(kind):
        def callback(step):
            if when.get(kind) == step:
                requests.reason = f"SIGUSR1 during {kind} {step}"

        return callback

    err = None
    try:
        trainer.fit(on_step=at("step"), on_validate=at("validation"), on_save=at("save"))
    except PreemptedError as caught:
        err = caught
    return trainer, err


def test_a_request_during_a_step_saves_that_step_logs_it_and_ends_before_the_next(tmp_path):
    trainer, err = _run(tmp_path, step=3)
    assert err is not None and err.step == 3 and f"exit {EXIT_CODE}" in str(err)
    assert trainer.saves == [3]
    assert trainer.logged == [1, 2, 3]  # the stopping step's metrics are logged before the run ends
    assert trainer.validations == [1, 2]  # the stopping step's validation is skipped
    assert trainer.finished == 1  # the trackers are flushed once, before the exception
    assert trainer.stop.saved_step == 3 and trainer.stop.policy.longest_save_s is not None
    assert trainer.announced == [f"step 3 in {tmp_path / 'global_step_3'}"]  # for a waiting preStop hook


def test_a_request_during_validation_saves_the_finished_step_under_its_own_number(tmp_path):
    trainer, err = _run(tmp_path, validation=2)
    assert err.step == 2 and trainer.saves == [2]  # saved at on_step_begin of step 3, as step 2
    assert trainer.global_steps == 3  # verl's counter put back after the save
    assert trainer.logged == [1, 2] and trainer.validations == [1, 2]


def test_a_request_during_the_periodic_save_does_not_save_twice(tmp_path):
    trainer, err = _run(tmp_path, save_freq=2, save=4)
    assert err.step == 4 and trainer.saves == [2, 4] and len(trainer.announced) == 1


def test_a_request_during_the_last_step_lets_the_run_end_normally(tmp_path):
    trainer, err = _run(tmp_path, total=3, step=3)
    assert err is None and trainer.saves == [] and trainer.logged == [1, 2, 3] and trainer.announced == []


def test_a_stop_after_an_earlier_periodic_save_saves_its_own_step(tmp_path):
    # step 2's periodic save is not step 3's: the stop saves step 3 itself
    trainer, err = _run(tmp_path, save_freq=2, step=3)
    assert err.step == 3 and trainer.saves == [2, 3]
    assert trainer.announced == [f"step 3 in {tmp_path / 'global_step_3'}"]


def test_no_request_no_stop(tmp_path):
    trainer, err = _run(tmp_path, total=4, save_freq=2)
    assert err is None and trainer.saves == [2, 4] and trainer.validations == [1, 2, 3, 4]


def test_the_deadline_stops_the_run_when_a_step_and_a_save_no_longer_fit(tmp_path, capsys):
    now = [0.0]
    stop = TrainerStop(
        PreemptionParams(deadline=1000.0, margin_s=50.0, save_estimate_s=100.0),
        job_id="job",
        clock=lambda: now[0],
        requests=lambda: None,
        announce=lambda message: None,
    )
    trainer = StandInTrainer(stop, 100, tmp_path)
    real_after = stop.after_step

    def ten_second_steps(t):
        now[0] += 10.0  # each step takes 10 s; the save (0 s here) is then timed at 0
        return real_after(t)

    stop.after_step = ten_second_steps
    with pytest.raises(PreemptedError) as err:
        trainer.fit()
    # step k ends at 10k; it stops at the first k with 1000 - 10k < 1.5 x 10 + 100 + 50: k = 84
    assert err.value.step == 84 and trainer.saves == [84]
    assert (
        "160 s left before the job's end, less than a step (10 s × step_factor 1.5) + a save (100 s, save_estimate_s)"
        in capsys.readouterr().out
    )


def test_the_default_clock_is_the_wall_clock(tmp_path):
    # the deadline is a Unix time: the trainer's clock must be time.time (not time.monotonic) for it to stop
    stop = TrainerStop(
        PreemptionParams(deadline=time.time() + 100.0, margin_s=60.0, save_estimate_s=300.0),
        job_id="job",
        requests=lambda: None,
        announce=lambda message: None,
    )
    trainer = StandInTrainer(stop, 5, tmp_path)
    with pytest.raises(PreemptedError) as err:
        trainer.fit()
    assert err.value.step == 1 and trainer.saves == [1]


def test_a_save_is_timed_in_seconds_on_the_trainers_clock(tmp_path, capsys):
    now = [1000.0]
    stop = _clocked_stop(now)
    trainer = StandInTrainer(stop, 3, tmp_path)
    trainer.global_steps = 2
    stop.reason = "a test"  # a stop's save logs its duration
    with stop.timed_save(trainer):
        now[0] += 30.0
    assert stop.policy.longest_save_s == 30.0 and stop.saved_step == 2
    assert "checkpoint of step 2 saved in 30.0 s" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------- the driver


def test_the_driver_relays_the_first_signal_and_logs_the_second(monkeypatch):
    out = io.StringIO()
    relay = DriverRelay(PreemptionParams(signals=("SIGUSR1", "SIGTERM")), out=out)
    relay._thread = object()  # no relay thread: this process has no Ray cluster
    previous = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        relay.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # during the save: logged, nothing else
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert relay.received == ["SIGUSR1", "SIGTERM"] and relay._pending.is_set()
    lines = out.getvalue().splitlines()
    assert lines[0] == f"gtpo preemption: SIGUSR1 received: the trainer saves after the step in flight, then the run " \
        f"exits with {EXIT_CODE}"  # fmt: skip
    assert lines[1].startswith("gtpo preemption: SIGTERM received again: the stop is under way")


def test_the_error_crosses_pickling_with_its_step():
    import pickle

    err = pickle.loads(pickle.dumps(PreemptedError("stopped", step=7)))
    assert isinstance(err, PreemptedError) and err.step == 7 and str(err) == "stopped"
