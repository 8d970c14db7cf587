"""The CPU demo's results: rewards from verl's file logger, the run summary, and the curves and token heatmap."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from gtpo.cpu.demo_trainer import REPO_ROOT
from gtpo.metric_log import read_file_log

REWARD_KEY = "critic/score/mean"


# ----------------------------------------------------------------------------------------------------------------
# results


def load_rewards(metrics_path: str | os.PathLike, key: str = REWARD_KEY) -> list[tuple[int, float]]:
    """``[(step, mean reward)]`` from verl's file-logger JSONL (a truncated last line is skipped)."""
    path = Path(metrics_path)
    if not path.is_file():
        return []
    by_step: dict[int, float] = {}
    for rec, data in file_logger_records(path):
        value = data.get(key) if isinstance(data, dict) else None
        if isinstance(value, int | float) and math.isfinite(value):
            by_step[int(rec["step"])] = float(value)
    return sorted(by_step.items())


def file_logger_records(path: Path) -> Iterator[tuple[dict, object]]:
    """``(record, data)`` per step of verl's file-logger JSONL (``gtpo.metric_log.read_file_log``: a step logged twice
    counts once, the later record wins); a line still being written is skipped."""
    for step, data in read_file_log(path, strict=False):
        yield {"step": step, "data": data}, data


def summarize(rewards: list[tuple[int, float]], window: int = 10, target: float = 0.8) -> dict:
    """Mean reward of the first / last ``window`` steps and the first step whose trailing window mean >= target."""
    values = [v for _, v in rewards]
    if not values:
        return {"steps": 0}
    w = min(window, len(values))
    reached = None
    for i in range(window - 1, len(values)):
        if sum(values[i - window + 1 : i + 1]) / window >= target:
            reached = rewards[i][0]
            break
    return {
        "steps": len(values),
        "window": w,
        "first_mean": sum(values[:w]) / w,
        "last_mean": sum(values[-w:]) / w,
        "target": target,
        "step_reaching_target": reached,
    }


def token_dumps(rollout_dir: Path) -> dict[int, Path]:
    """``{step: path}`` of the ``tokens_<step>.jsonl`` dumps in ``rollout_dir``."""
    found: dict[int, Path] = {}
    for p in rollout_dir.glob("tokens_*.jsonl"):
        suffix = p.stem.split("_", 1)[1]
        if suffix.isdigit():
            found[int(suffix)] = p
    return found


def latest_token_dump(rollout_dir: Path) -> Path | None:
    """The ``tokens_<step>.jsonl`` with the highest step in ``rollout_dir``, if any."""
    dumps = token_dumps(rollout_dir)
    return dumps[max(dumps)] if dumps else None


def heatmap_step(rewards: list[tuple[int, float]], available: set[int]) -> int | None:
    """The latest available step whose batch reward is closest to 0.5 (most groups mix correct and wrong samples).

    Late in a run every group is all-correct: GRPO's advantages are then all 0 and the picture shows nothing.
    Falls back to the latest available step when no reward is known for any of them.
    """
    known = [(s, v) for s, v in rewards if s in available]
    if not known:
        return max(available) if available else None
    return min(known, key=lambda sv: (abs(sv[1] - 0.5), -sv[0]))[0]


def run_viz(args: list[str], env: dict[str, str]) -> bool:
    """``python -m gtpo.viz <args>`` from the repository root; False (and its stderr printed) when it fails."""
    proc = subprocess.run(
        [sys.executable, "-m", "gtpo.viz", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        print(f"[demo] gtpo.viz {args[0]} failed (rc={proc.returncode}):\n{proc.stderr.strip()}", file=sys.stderr)
    return proc.returncode == 0


def make_plots(
    out: Path,
    name: str,
    metrics_path: Path,
    rollout_dir: Path,
    tokenizer_dir: str,
    also_plot: list[str],
    step: int | None = None,
) -> dict[str, object]:
    """Curves PNG and a token heatmap (HTML + PNG) of the run; returns what was written.

    The heatmap shows ``tokens_<step>.jsonl`` (per-token advantages) for ``step``, by default :func:`heatmap_step`;
    without token dumps it falls back to verl's text dump of that step, coloured by score.
    """
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    written: dict[str, object] = {}
    rewards = load_rewards(metrics_path)
    if metrics_path.is_file():
        runs = [arg for spec in [f"{name}={metrics_path}", *also_plot] for arg in ("--run", spec)]
        curves = out / "curves.png"
        panels = ["--metrics", REWARD_KEY, "actor/entropy"]
        if run_viz(["curves", *runs, *panels, "--out", str(curves), "--title", "CPU demo: say <d> -> <d>"], env):
            written["curves"] = str(curves)
    if not rollout_dir.is_dir():
        return written
    heat = out / "heatmap"
    dumps, colour = token_dumps(rollout_dir), "advantage"
    if not dumps:  # verl's own text dumps carry only the sequence score
        dumps, colour = {int(p.stem): p for p in rollout_dir.glob("*.jsonl") if p.stem.isdigit()}, "score"
    pick = step if step is not None or not dumps else heatmap_step(rewards, set(dumps))
    if pick in dumps and run_viz(
        ["tokens", "--input", str(dumps[pick]), "--out", str(heat), "--color", colour]
        + ["--tokenizer", tokenizer_dir, "--max-prompts", "4"],
        env,
    ):
        written.update(heatmap=str(heat), heatmap_step=pick)
    return written
