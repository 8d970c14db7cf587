"""The CPU demo's live progress line (gtpo.cpu.demo_progress): its text, the remaining-time estimate, and a trainer
subprocess whose output goes to the log while the line follows its file-logger JSONL. No Ray."""

from __future__ import annotations

import io
import json
import sys
import textwrap

from gtpo.cpu.demo_progress import (
    ProgressTracker,
    format_duration,
    latest_metrics,
    progress_text,
    run_trainer_with_progress,
)


def test_format_duration():
    assert format_duration(None) == "?"
    assert format_duration(7.4) == "7s"
    assert format_duration(75) == "1m15s"
    assert format_duration(600) == "10m00s"


def test_progress_text_before_and_after_the_first_step():
    assert progress_text("demo", 0, 100, None, None, 31.0, None) == (
        "[demo] step 0/100: starting Ray and the workers, elapsed 31s"
    )
    assert progress_text("demo", 12, 100, 0.3125, 2.05, 95.0, 230.0) == (
        "[demo] step 12/100, reward 0.31, entropy 2.05, elapsed 1m35s, remaining ~3m50s"
    )
    assert "reward ?, entropy ?" in progress_text("demo", 1, 5, None, None, 1.0, None)


def test_remaining_time_is_the_mean_step_time_since_the_first_step():
    t = ProgressTracker(total=10, start=0.0)
    t.update(1, 60.0)  # the first step includes the start-up: not a step time
    assert t.remaining(61.0) is None
    t.update(3, 66.0)  # 2 steps in 6 s: 3 s per step, 7 steps left
    assert t.remaining(66.0) == 21.0
    assert t.remaining(70.0) == 17.0  # time since the last step counts down
    t.update(2, 80.0)  # never goes back
    assert t.step == 3


def test_latest_metrics_skips_a_line_being_written(tmp_path):
    path = tmp_path / "m.jsonl"
    assert latest_metrics(path, ("r",)) == (0, {})
    path.write_text(json.dumps({"step": 1, "data": {"r": 0.5, "e": 2}}) + "\n" + '{"step": 2, "da')
    assert latest_metrics(path, ("r", "e", "missing")) == (1, {"r": 0.5, "e": 2.0})


FAKE_TRAINER = textwrap.dedent(
    """
    import json, sys, time
    path = sys.argv[1]
    print("verbose trainer output", flush=True)
    for step in (1, 2, 3):
        time.sleep(0.3)
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "data": {"critic/score/mean": step / 4, "actor/entropy": 3.0 - step}}))
            f.write("\\n")
    time.sleep(1.5)  # the trainer saves and shuts down after its last step: a later elapsed time, same step
    sys.exit(int(sys.argv[2]))
    """
)


def _run_fake(tmp_path, exit_code: int, timeout: float = 60.0):
    stream = io.StringIO()
    metrics = tmp_path / "metrics.jsonl"
    rc = run_trainer_with_progress(
        [sys.executable, "-c", FAKE_TRAINER, str(metrics), str(exit_code)],
        cwd=tmp_path, env={}, log_path=tmp_path / "train.log", metrics_path=metrics, total_steps=3,
        timeout=timeout, label="demo", stream=stream, poll_s=0.05,
    )  # fmt: skip
    return rc, stream.getvalue(), (tmp_path / "train.log").read_text()


def test_trainer_output_goes_to_the_log_and_progress_to_the_console(tmp_path):
    rc, console, log = _run_fake(tmp_path, 0)
    assert rc == 0
    assert "verbose trainer output" in log and "verbose trainer output" not in console
    lines = console.splitlines()
    # not a terminal: one line per tenth of the run, no carriage returns
    assert "\r" not in console
    assert lines[-1].startswith("[demo] step 3/3, reward 0.75, entropy 0.00, elapsed ")
    assert lines[-1].endswith("remaining ~0s")
    assert len(lines) == len(set(lines)) <= 5
    # one line for the last step, whether the polling loop saw it before the trainer exited or only the final show
    assert sum(line.startswith("[demo] step 3/3") for line in lines) == 1, lines


def test_exit_code_and_timeout_are_returned(tmp_path):
    assert _run_fake(tmp_path, 3)[0] == 3
    (tmp_path / "t").mkdir()
    assert _run_fake(tmp_path / "t", 0, timeout=0.1)[0] == 124


def test_a_terminal_gets_one_line_redrawn_in_place(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    metrics = tmp_path / "metrics.jsonl"
    run_trainer_with_progress(
        [sys.executable, "-c", FAKE_TRAINER, str(metrics), "0"],
        cwd=tmp_path, env={}, log_path=tmp_path / "train.log", metrics_path=metrics, total_steps=3,
        timeout=60, stream=stream, poll_s=0.05,
    )  # fmt: skip
    out = stream.getvalue()
    assert out.count("\n") == 1 and out.endswith("\n") and out.count("\r") >= 2
    assert out.rstrip().rsplit("\r", 1)[-1].startswith("[demo] step 3/3, reward 0.75")
