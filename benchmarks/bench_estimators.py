"""Advantage estimators side by side with verl's GRPO and with the memory-bandwidth floor.

Cases (each called through the same entry point the trainer uses, diagnostics included):

* ``grpo`` / ``grpo_vec``   verl 0.9.1 ``compute_grpo_outcome_advantage`` /
  ``compute_grpo_vectorized_outcome_advantage``
* ``gtpo_zero_fill``        ``compute_gtpo_advantage`` with the recipe's defaults (paper A: ``norm_mode=zero_fill``,
  ``norm_scope=batch``, ``weight_scope=batch``)
* ``gtpo_grop``             the same with ``algorithm.grop.enable=true`` (the ``gtpo`` preset: bases that vary)
* ``gtpo_split`` / ``gtpo_joint``  the same with ``algorithm.gtpo.norm_mode`` split / joint (batch scopes)
* ``grpo_s``                ``compute_grpo_s_advantage``
* ``gtpo_traj``             ``compute_gtpo_traj_advantage`` (paper variant, conflict tokens + entropy filter)
* ``conflict``              ``conflict_weights`` alone (GTPO-trajectory's conflict-token detection)
* ``forking``               ``top_entropy_mask`` (top-20 % entropy tokens of the batch)

Inputs look like a DAPO batch: groups of 16 responses, rows shuffled, uid strings as ``index``, lengths uniform in
``[L/8, L]``, a 0/1 reward on the last valid token (per-group success rate uniform in [0, 1]), float32 entropies
rounded to bf16 (70 % near-deterministic tokens, 30 % forking-like), float32 ``response_mask`` (as in the issue's
floor); token ids from a 151k vocabulary where the responses of a group share a prefix of 0-64 and a suffix of
0-16 tokens (so conflict runs exist).

The recipe's estimators run their numba CPU kernels; the warm-up call compiles them (or loads numba's disk cache).
Every (case, size) runs in its own subprocess: ``time`` is the median over ``--repeats`` runs after one warm-up,
``peak MB`` the RSS high-water mark of the runs above the resident inputs (CPU; ``/proc/self/clear_refs`` reset
after the inputs are built) or ``torch.cuda.max_memory_allocated`` above the inputs (CUDA). ``floor`` is the bytes
the estimator must at least read and write (e.g. gtpo: rewards, mask, entropy in; advantages, returns out; all
float32, token ids int64) over the copy bandwidth measured in the same run at the same thread count (one thread
moves fewer bytes per second than two: the floor of a one-thread row is the one-thread bandwidth's).

Sizes: paper A's scale (128 prompts x 16 = 2048 responses of up to 4096 tokens; 6144 with a longer budget) and DAPO's
(512 x 16 = 8192 responses of up to 20480 tokens).

``--threads 1,2`` (or ``--threads 1 2``) runs every case at each thread count (``torch.set_num_threads`` in the
workers; the kernels use as many) and ends with one table of each estimator's ratio to ``grpo_vec`` (or ``grpo``) per
thread count, the figure the recipe's goal is stated in (every estimator <= 1.0x ``grpo_vectorized``).

Usage: .venv/bin/python benchmarks/bench_estimators.py [--quick] [--device cpu|cuda] [--sizes 2048x4096,...]
       [--cases gtpo_split,grpo_vec] [--repeats N] [--threads 1,2] [--no-write]
Writes its tables into benchmarks/RESULTS.md (section ``estimators-<device>[-t<threads>]`` and, with several thread
counts, ``estimators-<device>-ratios``; other sections are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from benchmarks import _common as C  # noqa: E402

GROUP = 16
FULL = (8192, 20480)
DEFAULT_SIZES = [(2048, 4096), (2048, 6144), FULL]
QUICK_SIZES = [(256, 1024), (1024, 4096)]

# bytes per (row, position) that must move: float32 = 4, int64 ids = 8, bool mask out = 1
CASES = {
    "grpo": ("verl grpo (loop)", 16),  # rewards, mask in; advantages, returns out
    "grpo_vec": ("verl grpo_vectorized", 16),
    "gtpo_zero_fill": ("gtpo, defaults (zero_fill, batch scopes)", 20),  # + entropy in
    "gtpo_grop": ("gtpo, defaults + grop.enable=true", 20),
    "gtpo_split": ("gtpo, norm_mode=split", 20),
    "gtpo_joint": ("gtpo, norm_mode=joint", 20),
    "grpo_s": ("grpo_s", 20),
    "gtpo_traj": ("gtpo_traj (paper)", 28),  # + token ids (int64) in
    "conflict": ("gtpo_traj conflict detection only", 13),  # ids, mask in; bool out
    "forking": ("forking top_entropy_mask (rho=0.2)", 9),  # entropy, mask in; bool mask out
}
NEEDS_IDS = {"gtpo_traj", "conflict"}


# ---------------------------------------------------------------------------------------------------------------
# inputs


def make_inputs(b: int, length: int, device: str, need_ids: bool, seed: int = 0) -> dict:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ng = max(1, b // GROUP)
    gid = torch.arange(b) % ng
    perm = torch.randperm(b, generator=g)
    gid = gid[perm]
    index = np.array([f"uid-{int(i):06d}" for i in gid.tolist()], dtype=object)
    lo = max(1, length // 8)
    lens = torch.randint(lo, length + 1, (b,), generator=g)
    pos = torch.arange(length)
    mask = (pos[None, :] < lens[:, None]).to(torch.float32)
    p_group = torch.rand(ng, generator=g)
    correct = (torch.rand(b, generator=g) < p_group[gid]).to(torch.float32)
    tlr = torch.zeros(b, length)
    tlr[torch.arange(b), lens - 1] = correct
    # entropy: bf16-rounded mixture, computed in row chunks to bound the temporaries
    ent = torch.empty(b, length)
    step = max(1, (1 << 24) // max(length, 1))
    for s in range(0, b, step):
        e = slice(s, min(b, s + step))
        u = torch.rand(e.stop - s, length, generator=g)
        low = torch.empty_like(u).exponential_(20.0, generator=g)
        high = torch.empty_like(u).exponential_(0.7, generator=g)
        h = torch.where(u < 0.7, low, high).to(torch.bfloat16).to(torch.float32)
        ent[e] = h.mul_(mask[e])
    out = {"tlr": tlr, "mask": mask, "index": index, "entropy": ent, "gid": gid, "ng": ng, "correct": correct}
    if need_ids:
        vocab = 151_000
        resp = torch.randint(0, vocab, (b, length), generator=g, dtype=torch.int64)
        template = torch.randint(0, vocab, (ng, 64), generator=g, dtype=torch.int64)
        tail = torch.randint(0, vocab, (ng, 16), generator=g, dtype=torch.int64)
        pre = torch.from_numpy(rng.integers(0, 65, b))
        suf = torch.from_numpy(rng.integers(0, 17, b))
        k64 = torch.arange(64)
        use = k64[None, :] < pre[:, None]
        resp[:, :64] = torch.where(use, template[gid], resp[:, :64])
        for r in range(b):  # shared right-aligned suffix (setup only, not timed)
            n = min(int(suf[r]), int(lens[r]))
            if n:
                resp[r, int(lens[r]) - n : int(lens[r])] = tail[gid[r], 16 - n :]
        resp.masked_fill_(mask == 0, 0)
        out["responses"] = resp
    if device != "cpu":
        for k in ("tlr", "mask", "entropy", "gid", "correct", "responses"):
            if k in out:
                out[k] = out[k].to(device)
    return out


def make_call(case: str, inp: dict):
    from omegaconf import OmegaConf

    if case in ("grpo", "grpo_vec"):
        from verl.trainer.ppo import core_algos as ca

        fn = ca.compute_grpo_outcome_advantage if case == "grpo" else ca.compute_grpo_vectorized_outcome_advantage
        return lambda: fn(inp["tlr"], inp["mask"], inp["index"])
    if case in ("gtpo_traj", "grpo_s") or case.startswith("gtpo_"):
        from verl.trainer.ppo.core_algos import get_adv_estimator_fn

        import gtpo.verl_plugin.register  # noqa: F401  (the recipe's estimators in verl's registry)

        if case == "gtpo_traj":
            cfg = OmegaConf.create({"gtpo_traj": {"h_ini": 0.3}})
        elif case == "grpo_s":
            cfg = OmegaConf.create({"grpo_s": {}})
        elif case == "gtpo_grop":
            cfg = OmegaConf.create({"gtpo": {}, "grop": {"enable": True}})
        else:
            cfg = OmegaConf.create({"gtpo": {"norm_mode": case[len("gtpo_") :]}})
        fn = get_adv_estimator_fn(case if case in ("gtpo_traj", "grpo_s") else "gtpo")
        return lambda: fn(
            inp["tlr"],
            inp["mask"],
            inp["index"],
            cfg,
            entropy=inp["entropy"],
            responses=inp.get("responses"),
            metrics={},
        )
    if case == "conflict":
        from gtpo.algorithms.conflict_tokens import conflict_weights
        from gtpo.algorithms.gtpo_traj import centred_advantages

        _, pol, _ = centred_advantages(inp["correct"].cpu(), inp["gid"].cpu(), inp["ng"], "std")
        pol = pol.to(inp["mask"].device)
        return lambda: conflict_weights(inp["responses"], inp["mask"], inp["gid"], inp["ng"], pol)
    if case == "forking":
        from gtpo.algorithms.token_selection import top_entropy_mask

        return lambda: top_entropy_mask(inp["entropy"], inp["mask"], 0.2)
    raise ValueError(f"unknown case {case!r}")


# ---------------------------------------------------------------------------------------------------------------
# worker (one case, one size, own process)


def worker(case: str, b: int, length: int, device: str, repeats: int, threads: int | None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    cuda = device.startswith("cuda")
    inp = make_inputs(b, length, device, case in NEEDS_IDS)
    call = make_call(case, inp)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    import gc

    gc.collect()
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        C.reset_peak_rss()
        base = C.rss_mb()
    out = call()  # warm-up (imports, allocator)
    del out
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = call()
        sync()
        times.append(time.perf_counter() - t0)
        del out
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = C.peak_rss_mb() - base
    return {"median_s": statistics.median(times), "min_s": min(times), "times": times, "peak_mb": peak}


def copy_bandwidth(device: str, threads: int | None = None, mb: int = 512) -> float:
    """Copy bandwidth in bytes/s, counting read + write bytes (median of 7 copies of an ``mb`` MiB tensor), on
    ``threads`` torch threads (default: as set)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _copy_bandwidth(device, mb)
    finally:
        torch.set_num_threads(before)


def _copy_bandwidth(device: str, mb: int) -> float:
    import torch

    n = mb * 2**20 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dst.copy_(src)
    ts = []
    for _ in range(7):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        ts.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(ts)


# ---------------------------------------------------------------------------------------------------------------
# driver


def parse_sizes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        b, length = part.lower().split("x")
        out.append((int(b), int(length)))
    return out


def input_bytes(case: str, b: int, length: int) -> int:
    per = 4 * 4 + (8 if case in NEEDS_IDS else 0)  # rewards, mask, entropy (+ generation temporaries) + ids
    return per * b * length


def run_case(case, b, length, args, threads=None) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        case,
        f"{b}x{length}",
        "--device",
        args.device,
        "--repeats",
        str(args.repeats),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    if args.device == "cpu":
        need_gb = (input_bytes(case, b, length) + 8 * 4 * b * length) / 2**30
        avail = C.mem_available_gb()
        if avail < need_gb + 1.0:
            return {"skip": f"needs ~{need_gb:.1f} GB, {avail:.1f} GB available"}
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"skip": f"timeout > {args.case_timeout} s"}
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
        return {"skip": f"rc={res.returncode}: {tail[0][:120]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def fmt_t(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes only, 3 repeats")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--sizes", default=None, help="comma list of BxL (default: 256x1024 ... 8192x20480)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 5, --quick 3)")
    p.add_argument("--threads", nargs="+", default=None, help="torch.set_num_threads: one or more counts")
    p.add_argument("--case-timeout", type=float, default=900.0)
    p.add_argument("--no-write", action="store_true", help="do not write benchmarks/RESULTS.md")
    p.add_argument("--worker", nargs=2, metavar=("CASE", "BxL"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        ((b, length),) = parse_sizes(args.worker[1])
        threads = int(args.threads[0]) if args.threads else None
        res = worker(args.worker[0], b, length, args.device, args.repeats or 5, threads)
        print(json.dumps(res))
        return 0

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False on this machine", file=sys.stderr)
        return 2
    sizes = parse_sizes(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    args.repeats = args.repeats or (3 if args.quick else 5)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; choose from {list(CASES)}")
    thread_counts = [int(t) for part in (args.threads or []) for t in part.split(",") if t] or [None]
    args.load_at_start = os.getloadavg()[0]
    by_threads, bws = {}, {}
    for threads in thread_counts:
        bws[threads] = copy_bandwidth(args.device, threads)
        print(f"copy bandwidth ({args.device}, {threads or 'default'} thread(s)): {bws[threads] / 1e9:.1f} GB/s "
              "(read + write bytes)", flush=True)  # fmt: skip
        by_threads[threads] = measure(cases, sizes, args, bws[threads], threads)
    for threads, rows in by_threads.items():
        table = result_table(rows)
        print(f"\n{threads or 'default'} thread(s)\n{table}")
        if not args.no_write:
            write_results(args, cases, {threads: bws[threads]}, table, threads)
    if len(thread_counts) > 1:
        ratios = ratio_table(by_threads)
        print(f"\nratio to grpo_vec (grpo) per thread count\n{ratios}")
        if not args.no_write:
            write_results(args, cases, bws, ratios, None, suffix="-ratios", title=" ratios per thread count")
    return 0


def measure(cases, sizes, args, bw, threads) -> list[dict]:
    """Every (size, case) at one thread count, each in its own process; one row dict each."""
    rows = []
    for b, length in sizes:
        results = {}
        for case in cases:
            r = run_case(case, b, length, args, threads)
            results[case] = r
            floor = CASES[case][1] * b * length / bw
            if "skip" in r:
                print(f"t{threads} {b}x{length} {case:11s} skipped: {r['skip']}", flush=True)
            else:
                print(
                    f"t{threads} {b}x{length} {case:11s} {fmt_t(r['median_s']):>10s}  peak +{r['peak_mb']:.0f} MB  "
                    f"x floor {r['median_s'] / floor:.1f}",
                    flush=True,
                )
        for case in cases:
            r = results[case]
            floor = CASES[case][1] * b * length / bw
            row = {"size": f"{b}x{length}", "case": case, "floor_s": floor, **r}
            for ref in ("grpo", "grpo_vec"):
                rr = results.get(ref)
                if "skip" not in r and rr and "skip" not in rr:
                    row[f"x_{ref}"] = r["median_s"] / rr["median_s"]
            rows.append(row)
    return rows


def result_table(rows: list[dict]) -> str:
    head = "| B x L | estimator | median | peak MB | x grpo | x grpo_vec | floor | x floor |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skip" in r:
            lines.append(f"| {r['size']} | {r['case']} | skipped: {r['skip']} | | | | | |")
            continue
        xg = f"{r['x_grpo']:.2f}" if "x_grpo" in r else "-"
        xv = f"{r['x_grpo_vec']:.2f}" if "x_grpo_vec" in r else "-"
        lines.append(
            f"| {r['size']} | {r['case']} | {fmt_t(r['median_s'])} | {r['peak_mb']:.0f} | {xg} | {xv} | "
            f"{fmt_t(r['floor_s'])} | {r['median_s'] / r['floor_s']:.1f} |"
        )
    return "\n".join(lines)


def ratio_table(by_threads: dict) -> str:
    """One row per (size, estimator): its ratio to grpo_vec (else grpo) and its x floor at each thread count."""
    counts = list(by_threads)
    head = "| B x L | estimator | " + " | ".join(f"x grpo_vec t{t} | x floor t{t}" for t in counts) + " |"
    lines = [head, "|---|---|" + "---:|---:|" * len(counts)]
    first = by_threads[counts[0]]
    for k, row in enumerate(first):
        cells = []
        for t in counts:
            r = by_threads[t][k]
            ref = r.get("x_grpo_vec", r.get("x_grpo"))
            cells.append(f"{ref:.2f}" if ref is not None else "-")
            cells.append(f"{r['median_s'] / r['floor_s']:.1f}" if "skip" not in r else "-")
        lines.append(f"| {row['size']} | {row['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(args, cases, bws: dict, table, threads, suffix="", title="") -> None:
    """Write one table into RESULTS.md; ``bws`` maps each thread count of the table to its copy bandwidth."""
    bandwidth = ", ".join(f"{bw / 1e9:.1f} GB/s" + (f" at {t} thread(s)" if t else "") for t, bw in bws.items())
    legend = "\n".join(f"- `{k}`: {v[0]}; floor bytes = {v[1]} x B x L" for k, v in CASES.items() if k in cases)
    body = (
        f"### {C.stamp()}\n\n`{C.command_line()}`  \nMachine: {C.machine(args.device)} "
        f"({args.load_at_start:.1f} at the start of the run)  \n"
        f"Copy bandwidth (read + write): {bandwidth}; {args.repeats} timed runs per case (median), "
        f"each case in its own process; peak MB = RSS high-water above the resident inputs.\n\n{legend}\n\n{table}\n"
    )
    name = "estimators-cuda" if args.device.startswith("cuda") else "estimators-cpu"
    label = "Advantage estimators (" + ("CUDA" if name.endswith("cuda") else "CPU") + ")"
    if threads:
        name += f"-t{threads}"
        label = label[:-1] + f", {threads} torch thread(s))"
    C.write_section(name + suffix, label[:-1] + title + ")" if title else label, body)


if __name__ == "__main__":
    raise SystemExit(main())
