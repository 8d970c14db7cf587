"""The CPU demo's trainer subprocess with one live console line (step/total, reward, entropy, elapsed, remaining).

The trainer's own output (Ray, workers, verl's per-step console metrics) goes to a log file; progress is read from
verl's file-logger JSONL while the trainer runs. On a terminal the line is redrawn in place; otherwise (a CI log, a
pipe) it is printed as a new line at most every tenth of the run, so logs stay short.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from gtpo.metric_log import read_file_log

ENTROPY_KEY = "actor/entropy"


def format_duration(seconds: float | None) -> str:
    """``75`` -> ``"1m15s"``; ``None`` -> ``"?"``."""
    if seconds is None:
        return "?"
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def progress_text(
    label: str,
    step: int,
    total: int,
    reward: float | None,
    entropy: float | None,
    elapsed: float,
    remaining: float | None,
) -> str:
    """One progress line; before the first step it says that the trainer is starting."""
    if step == 0:
        return f"[{label}] step 0/{total}: starting Ray and the workers, elapsed {format_duration(elapsed)}"
    fields = [f"[{label}] step {step}/{total}"]
    fields.append(f"reward {reward:.2f}" if reward is not None else "reward ?")
    fields.append(f"entropy {entropy:.2f}" if entropy is not None else "entropy ?")
    fields.append(f"elapsed {format_duration(elapsed)}")
    fields.append(f"remaining ~{format_duration(remaining)}")
    return ", ".join(fields)


class ProgressTracker:
    """Step times seen so far, and the estimate of the remaining time from the mean time per step."""

    def __init__(self, total: int, start: float):
        self.total = total
        self.start = start
        self.step = 0
        self.first_step_at: float | None = None
        self.first_step = 0
        self.last_step_at: float | None = None

    def update(self, step: int, now: float) -> None:
        if step > self.step:
            if self.first_step_at is None:
                self.first_step_at, self.first_step = now, step
            self.step, self.last_step_at = step, now

    def remaining(self, now: float) -> float | None:
        """Seconds left: the steps still to run times the mean step time since the first step (None before)."""
        if self.first_step_at is None or self.step <= self.first_step:
            return None
        per_step = (self.last_step_at - self.first_step_at) / (self.step - self.first_step)
        return max(0.0, per_step * (self.total - self.step) - (now - self.last_step_at))


def latest_metrics(metrics_path: Path, keys: tuple[str, ...]) -> tuple[int, dict[str, float]]:
    """``(last step, {key: value at that step})`` of a file-logger JSONL being written; ``(0, {})`` before."""
    if not metrics_path.is_file():
        return 0, {}
    records = read_file_log(metrics_path, strict=False)
    if not records:
        return 0, {}
    step, data = records[-1]
    return step, {k: float(data[k]) for k in keys if isinstance(data.get(k), int | float)}


def run_trainer_with_progress(
    cmd: list[str],
    *,
    cwd: str | Path,
    env: dict[str, str],
    log_path: Path,
    metrics_path: Path,
    total_steps: int,
    timeout: float,
    label: str = "demo",
    reward_key: str = "critic/score/mean",
    stream: TextIO | None = None,
    poll_s: float = 1.0,
) -> int:
    """Run ``cmd`` with stdout and stderr into ``log_path``, drawing the progress line on ``stream``.

    Returns:
        the trainer's exit code, or 124 when it was killed after ``timeout`` seconds.
    """
    stream = stream or sys.stdout
    live = stream.isatty()
    start = time.monotonic()
    tracker = ProgressTracker(total_steps, start)
    printed_bucket = -1
    printed_step: int | None = None
    width = 0

    def show(final: bool = False) -> None:
        nonlocal printed_bucket, printed_step, width
        now = time.monotonic()
        step, values = latest_metrics(metrics_path, (reward_key, ENTROPY_KEY))
        tracker.update(step, now)
        text = progress_text(
            label,
            tracker.step,
            total_steps,
            values.get(reward_key),
            values.get(ENTROPY_KEY),
            now - start,
            tracker.remaining(now),
        )
        if live:
            stream.write("\r" + text.ljust(width) + ("\n" if final else ""))
            width = len(text)
            stream.flush()
            return
        bucket = tracker.step * 10 // max(total_steps, 1)
        # the final line is shown unless a line of the same step already was (the last step's line says it all)
        if (final and tracker.step != printed_step) or bucket > printed_bucket:
            printed_bucket, printed_step = bucket, tracker.step
            stream.write(text + "\n")
            stream.flush()

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout:
                    proc.kill()
                    proc.wait()
                    show(final=True)
                    return 124
                show()
                time.sleep(poll_s)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    show(final=True)
    return proc.returncode
