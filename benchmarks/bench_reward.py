"""Reward throughput: MATH-500 reference solutions plus pathological inputs, graded three ways.

* ``inline``    ``compute_score_inline`` on the main thread of this process (math-verify's soft alarms only).
* ``pool``      ``compute_score`` from as many threads as there are grading workers (how verl's reward loop
  calls it: executor threads of an async actor); per-call latency percentiles.
* ``batch``     ``compute_scores_batch`` (all cores) end to end; throughput only.

Pathological inputs: the power tower ``\\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}`` (C-level bigint work that outlives
alarms), 1 MB of filler before the box, a 1 MB box, a 900-term sum. The verdict cache is cleared between modes.
A call is "over limit" if it took longer than ``timeout_s`` + 2 s (the allowance for restarting a killed worker).

Usage: .venv/bin/python benchmarks/bench_reward.py [--n 500] [--workers N] [--timeout-s 10] [--no-write]
Appends the table to benchmarks/RESULTS.md under "Reward throughput".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gtpo.reward import math as reward_math  # noqa: E402
from gtpo.reward.pool import get_pool  # noqa: E402

DATA = Path(os.environ.get("GTPO_SHARED_DATA", REPO.parent / "shared" / "data"))
TOWER = r"\dfrac{5^{(5^{(5^{(5^5)})}-4)}-5}{16}"


def load_cases(n: int) -> list[tuple[str, str, str]]:
    """(kind, response, gold) triples."""
    cases = []
    with (DATA / "math500.jsonl").open() as f:
        for line in f:
            row = json.loads(line)
            cases.append(("math500", row["solution"], row["answer"]))
            if len(cases) >= n:
                break
    patho = [
        ("tower", rf"so the answer is \boxed{{{TOWER}}}", "5"),
        ("tower", rf"Answer: {TOWER}", "7"),
        ("filler_1MB", "lorem ipsum " * 87_000 + r"\boxed{42}", "42"),
        ("box_1MB", r"\boxed{" + "9" * 1_000_000 + "}", "9"),
        ("sum_900", r"\boxed{" + "+".join(["1"] * 450) + "}", "450"),
    ]
    # spread the pathological inputs through the workload
    step = max(1, len(cases) // (len(patho) + 1))
    for i, p in enumerate(patho):
        cases.insert((i + 1) * step, p)
    return cases


def _clear_cache() -> None:
    with reward_math._CACHE_LOCK:
        reward_math._CACHE.clear()


def run_inline(cases, timeout_s):
    lat, outs = [], []
    for _, resp, gold in cases:
        t0 = time.perf_counter()
        outs.append(reward_math.compute_score_inline("b", resp, gold, timeout_s=timeout_s))
        lat.append(time.perf_counter() - t0)
    return lat, outs


def run_pool(cases, workers, timeout_s):
    def one(case):
        t0 = time.perf_counter()
        out = reward_math.compute_score("b", case[1], case[2], timeout_s=timeout_s)
        return time.perf_counter() - t0, out

    with ThreadPoolExecutor(workers) as ex:
        res = list(ex.map(one, cases))
    return [r[0] for r in res], [r[1] for r in res]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=500, help="MATH-500 reference solutions to grade")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="grading processes")
    parser.add_argument("--timeout-s", type=float, default=10.0)
    parser.add_argument("--no-write", action="store_true", help="do not append to benchmarks/RESULTS.md")
    args = parser.parse_args()

    cases = load_cases(args.n)
    limit = args.timeout_s + 2.0
    # start the workers before timing: start-up is a one-off cost per process
    pool = get_pool(args.workers)
    pool.max_workers = max(pool.max_workers, args.workers)
    with ThreadPoolExecutor(args.workers) as ex:
        list(ex.map(lambda i: reward_math.compute_score("w", rf"\boxed{{{i}}}", str(i)), range(args.workers)))
    reward_math.compute_score_inline("w", r"\boxed{1}", "1")

    rows = []
    slowest = ("", 0.0)
    for mode in ("inline", "pool", "batch"):
        _clear_cache()
        t0 = time.perf_counter()
        if mode == "inline":
            lat, outs = run_inline(cases, args.timeout_s)
        elif mode == "pool":
            lat, outs = run_pool(cases, args.workers, args.timeout_s)
        else:
            outs = reward_math.compute_scores_batch(
                None, [c[1] for c in cases], [c[2] for c in cases], num_workers=args.workers, timeout_s=args.timeout_s
            )
            lat = None
        wall = time.perf_counter() - t0
        acc = np.mean([o["acc"] for o, c in zip(outs, cases, strict=True) if c[0] == "math500"])
        statuses = {}
        for o in outs:
            statuses[o["grade_status"]] = statuses.get(o["grade_status"], 0) + 1
        row = {
            "mode": mode,
            "procs": 1 if mode == "inline" else args.workers,
            "calls": len(cases),
            "wall_s": wall,
            "calls_s": len(cases) / wall,
            "math500_acc": acc,
            "statuses": statuses,
        }
        if lat is not None:
            lat = np.asarray(lat)
            row |= {"p50_ms": 1e3 * np.percentile(lat, 50), "p99_ms": 1e3 * np.percentile(lat, 99)}
            row |= {"max_s": lat.max(), "over_limit": int((lat > limit).sum())}
            worst = int(lat.argmax())
            if lat[worst] > slowest[1]:
                slowest = (f"{cases[worst][0]} ({mode})", float(lat[worst]))
        rows.append(row)

    head = (
        "| mode | procs | calls | wall s | calls/s | p50 ms | p99 ms | max s | over limit | MATH-500 acc | statuses |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lat_cells = (
            [f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['max_s']:.2f}", str(r["over_limit"])]
            if "p50_ms" in r
            else ["-", "-", "-", "-"]
        )
        status = ", ".join(f"{k}={v}" for k, v in sorted(r["statuses"].items()))
        cells = [r["mode"], str(r["procs"]), str(r["calls"]), f"{r['wall_s']:.2f}", f"{r['calls_s']:.1f}"]
        lines.append("| " + " | ".join(cells + lat_cells + [f"{100 * r['math500_acc']:.1f}%", status]) + " |")
    table = "\n".join(lines)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    machine = f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}, {platform.system()}"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    block = (
        f"### {stamp}\n\n`{cmd}`  \nMachine: {machine}  \n"
        f"Limit per call: {args.timeout_s:g} s (+2 s worker restart allowance); slowest call: "
        f"{slowest[0]} {slowest[1]:.2f} s.\n\n{table}\n"
    )
    print(block)
    if not args.no_write:
        _append(REPO / "benchmarks" / "RESULTS.md", block)
    over = sum(r.get("over_limit", 0) for r in rows)
    return 1 if over else 0


def _append(path: Path, block: str) -> None:
    """Insert ``block`` at the end of the "## Reward throughput" section (created if missing)."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    heading = "## Reward throughput"
    if heading not in text:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{block}"
    else:
        start = text.index(heading) + len(heading)
        nxt = text.find("\n## ", start)
        end = len(text) if nxt < 0 else nxt + 1
        text = text[:end].rstrip("\n") + "\n\n" + block + ("\n" + text[end:] if nxt >= 0 else "")
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
