"""Step overhead of GTPO over GRPO in the real trainer (CPU tiny-model backend).

Runs ``python -m recipe.gtpo.main_gtpo backend=cpu_tiny`` twice with the CPU demo's settings (8 prompts x 16
responses, tiny Qwen2 model, same seed), once with ``algorithm.adv_estimator=grpo`` and once with ``=gtpo``
(the recipe's defaults, as in the demo; nothing else differs), and reads the per-step timings
``timing_s/step`` and ``timing_s/adv`` from verl's file logger. The first ``--warmup`` steps are left out.

Reported: median step time of each run and their ratio, the median advantage time of each run, and the overhead
estimate ``(median adv_gtpo - median adv_grpo) / median step_grpo``, which is what GTPO adds to a step (the raw
step ratio also carries the run-to-run noise of generation on a shared machine).

Trainer runs use ~8 GB RAM and both cores: the script waits (re-checking every 60 s, up to ``--max-wait`` s) until
no other ``main_gtpo`` / ``main_ppo`` process runs, and checks again before the second run.

Usage: .venv/bin/python benchmarks/bench_step_overhead.py [--steps 8] [--warmup 2] [--no-write]
Writes its table into benchmarks/RESULTS.md (section ``step-overhead``; other sections are kept).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import _common as C  # noqa: E402

ESTIMATOR_SETTINGS = {"grpo": (), "gtpo": ()}


def other_trainers() -> list[str]:
    res = subprocess.run(["pgrep", "-af", "main_gtpo|main_ppo"], capture_output=True, text=True)
    me = str(os.getpid())
    return [ln for ln in res.stdout.splitlines() if ln.strip() and ln.split()[0] != me and "pgrep" not in ln]


def wait_idle(max_wait: float) -> bool:
    t0 = time.time()
    while True:
        busy = other_trainers()
        if not busy:
            return True
        if time.time() - t0 > max_wait:
            return False
        print(f"waiting: {len(busy)} trainer process(es) running ({busy[0][:100]}...)", flush=True)
        time.sleep(60)


def run_trainer(estimator: str, steps: int, seed: int, workdir: Path, timeout: float) -> tuple[list[dict], str]:
    from gtpo.cpu import demo

    assets = demo.build_demo_assets(seed=seed)
    metrics = workdir / f"{estimator}.jsonl"
    overrides = demo.demo_overrides(assets, steps, seed, experiment=f"overhead_{estimator}")
    overrides += [f"algorithm.adv_estimator={estimator}", *ESTIMATOR_SETTINGS[estimator]]
    cmd = [
        sys.executable,
        "-m",
        "recipe.gtpo.main_gtpo",
        "backend=cpu_tiny",
        *overrides,
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics}",
        f"hydra.run.dir={workdir / ('hydra_' + estimator)}",
    ]
    log = workdir / f"{estimator}.log"
    with log.open("w") as f:
        res = subprocess.run(
            cmd, cwd=REPO_ROOT, env=demo.trainer_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout
        )
    rows = []
    if metrics.exists():
        for d, data in demo.file_logger_records(metrics):
            if "timing_s/step" in data:
                rows.append({"step": d.get("step"), "step_s": data["timing_s/step"], "adv_s": data.get("timing_s/adv")})
    if res.returncode != 0 and not rows:
        tail = log.read_text().strip().splitlines()[-5:]
        raise RuntimeError(f"{estimator} run failed (rc={res.returncode}); log {log}:\n" + "\n".join(tail))
    return rows, " ".join(cmd[1:4] + [f"algorithm.adv_estimator={estimator}", *ESTIMATOR_SETTINGS[estimator]])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wait", type=float, default=3600.0, help="seconds to wait for other trainer runs to end")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per trainer run")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")

    results = {}
    with tempfile.TemporaryDirectory(prefix="gtpo_overhead_") as tmp:
        for est in ("grpo", "gtpo"):
            if not wait_idle(args.max_wait):
                print("other trainer runs still active after --max-wait; giving up", file=sys.stderr)
                return 3
            t0 = time.time()
            rows, cmd = run_trainer(est, args.steps, args.seed, Path(tmp), args.timeout)
            kept = [r for r in rows if r["step"] is not None and r["step"] > args.warmup]
            if not kept:
                print(f"{est}: no step timings after warm-up ({len(rows)} rows)", file=sys.stderr)
                return 4
            results[est] = {
                "steps": len(kept),
                "step_s": statistics.median(r["step_s"] for r in kept),
                "adv_s": statistics.median(r["adv_s"] for r in kept if r["adv_s"] is not None),
                "wall_s": time.time() - t0,
                "cmd": cmd,
            }
            print(f"{est}: {results[est]}", flush=True)

    g, t = results["grpo"], results["gtpo"]
    ratio = t["step_s"] / g["step_s"]
    overhead = (t["adv_s"] - g["adv_s"]) / g["step_s"]
    lines = [
        "| estimator | steps timed | median step s | median adv s | adv share of step |",
        "|---|---:|---:|---:|---:|",
    ]
    for est, r in results.items():
        lines.append(
            f"| {est} | {r['steps']} | {r['step_s']:.2f} | {r['adv_s'] * 1e3:.1f} ms | "
            f"{100 * r['adv_s'] / r['step_s']:.2f} % |"
        )
    table = "\n".join(lines)
    text = (
        f"Trainer: `{g['cmd']}` vs `{t['cmd']}` (CPU demo settings, seed {args.seed}, steps {args.warmup + 1}.."
        f"{args.steps} timed).\n\n{table}\n\n"
        f"- step time ratio gtpo / grpo: **{ratio:.3f}** (includes generation noise)\n"
        f"- GTPO overhead estimate (adv_gtpo - adv_grpo) / step_grpo: **{100 * overhead:.2f} %** (goal <= 3 %)\n"
    )
    C.report("step-overhead", "Step overhead (CPU tiny-model trainer)", text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
