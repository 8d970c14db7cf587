"""Methods x seeds on the CPU demo task through verl's real trainer: a table (markdown + JSON) and one figure.

    python -m gtpo.cpu.compare                                   # every configuration, 3 seeds, 100 steps
    python -m gtpo.cpu.compare --configs grpo,gtpo_zero_fill --seeds 1 --steps 40 --out outputs/compare
    python -m gtpo.cpu.compare --task second_word --out outputs/compare_second_word   # the second toy task
    python -m gtpo.cpu.compare --list                            # the configurations and their overrides
    python -m gtpo.cpu.compare --replot --out outputs/compare    # redraw table and figure of a finished sweep
    python -m gtpo.cpu.compare --resume --out outputs/compare    # keep the finished runs of a stopped sweep

Every run is :func:`gtpo.cpu.demo.run_demo`: the demo's task, model, budget and pinned settings (DEMO_SETTINGS), the
method preset, then the configuration's own estimator knobs (CONFIGURATIONS) and nothing else, so the runs differ only
in the method. ``--task`` picks the demo task (``say_digit``: the first response word decides the reward;
``second_word``: the second does, :mod:`gtpo.cpu.demo_task`). Seed ``s`` initialises the model and orders the data, the
same for every configuration. All runs join one Ray cluster, started here for the sweep (or ``--ray-address`` of a
running one): the Ray start-up is paid once, and every run is its own Ray job whose actors are freed when it ends.

Written into ``--out``: ``<configuration>/s<seed>/`` (the demo's ``metrics.jsonl``, ``train.log``, ``summary.json``),
``results.json`` (with the rollout, model, versions and commit that produced it), ``results.md`` and ``rewards.png``
(reward and entropy per step of every configuration: the mean over seeds with a min-max band, by
``python -m gtpo.viz curves``), the last three rewritten after every run. ``--resume`` keeps the runs of a stopped
sweep that finished: a run folder whose ``summary.json`` and ``metrics.jsonl`` show every step with exit 0, or a
complete run recorded in ``--out/results.json`` (every run record holds its per-step reward and entropy, so a sweep
continues from a copied ``results.json`` alone).

Per configuration the table gives the mean reward
of the first and of the last ``--window`` steps (mean +- std over seeds), the first step whose trailing
``--window``-step mean reaches ``--target`` (mean over the seeds that reached it, and how many did), the policy
entropy averaged over the last window, and the seconds per training step (``timing_s/step`` without the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gtpo.cpu.compare_results import (
    aggregate,
    finished_run,
    machine,
    markdown_table,
    provenance,
    read_earlier_results,
    recorded_run,
    run_record,
    series_path,
    write_outputs,
)
from gtpo.cpu.demo import DEFAULT_TASK, TASK_WORD_INDEX, build_demo_assets, run_demo
from gtpo.cpu.demo_trainer import REPO_ROOT
from gtpo.methods import METHODS

# name -> (method preset, Hydra overrides after the demo's settings): each row of the method table, once per named
# variant of its knobs (gtpo.methods.Method.variants). The estimator knobs are the only differences.
CONFIGURATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    (f"{row.name}_{suffix}" if suffix else row.name): (
        row.name,
        tuple(f"algorithm.{row.knobs}.{override}" for override in overrides),
    )
    for row in METHODS.values()
    for suffix, overrides in (row.variants or {"": ()}).items()
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gtpo.cpu.compare", description=__doc__.split("\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated names (default: all)")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per configuration (default 3)")
    p.add_argument("--steps", type=int, default=100, help="training steps of every run (default 100)")
    p.add_argument("--task", default=DEFAULT_TASK, choices=list(TASK_WORD_INDEX), help="demo task (say_digit)")
    p.add_argument("--out", default=str(REPO_ROOT / "outputs" / "compare"), help="output folder")
    p.add_argument("--window", type=int, default=10, help="steps averaged for first / last reward (default 10)")
    p.add_argument("--target", type=float, default=0.8, help="reward the trailing window mean must reach (0.8)")
    p.add_argument("--timeout", type=float, default=1800.0, help="kill a run after this many seconds")
    p.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS") or None,
        help="join this running Ray cluster instead of starting one (default $RAY_ADDRESS)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes of every run (default 1; more need --ray-address)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="FSDP ranks / vLLM replicas per node (default 1)")
    p.add_argument("--cache-dir", default=None, help="asset cache (default $GTPO_CACHE_DIR or ~/.cache/gtpo/tiny)")
    p.add_argument("--list", action="store_true", help="print the configurations and exit")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep every run in --out (its folder or results.json) that finished all --steps with exit 0",
    )
    p.add_argument(
        "--replot", action="store_true", help="redraw results.md and rewards.png from --out/results.json; no training"
    )
    return p


def parse_configs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown or not names:
        raise ValueError(f"--configs={text!r}: unknown {unknown or 'empty'}; known: {', '.join(CONFIGURATIONS)}")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------------------------------------------
# the sweep


def start_local_ray(gpus: int = 1) -> str:
    """Start a Ray head in this process for the sweep's runs (the CPU backend's environment); its GCS address.

    Like every cluster the recipe starts it is private to this user (:mod:`gtpo.launch.local_ray`: a new cluster
    whatever ``<tmp>/ray/ray_current_cluster`` names, a 0700 ``RAY_TMPDIR``, a fresh token, removed at exit; the runs
    inherit its variables): Ray 2.60 listens on the host's routable address whatever address it is given
    (``resolve_ip_for_localhost``; the GCS on every interface), so the token is what keeps other users out.
    """
    import ray

    from gtpo.cpu import env as cpu_env
    from gtpo.launch.local_ray import start_private_local_ray

    os.environ.update(cpu_env())
    os.environ.pop("RAY_ADDRESS", None)  # the sweep's own cluster, whatever the shell names
    start_private_local_ray({}, os.environ)
    ctx = ray.init(address="local", num_cpus=16, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    return ctx.address_info["gcs_address"]


def replot(out: Path) -> dict[str, str]:
    """Rewrite the table and the figure of the sweep in ``out`` from its ``results.json`` and the runs' metrics."""
    path = out / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"--replot: {path} does not exist (run the sweep with --out {out} first)")
    results = json.loads(path.read_text())
    seeds_paths = [
        (name, series_path(out / name / f"s{run['seed']}", run))
        for name, cfg in results["configurations"].items()
        for run in cfg["runs"]
    ]
    return write_outputs(out, results, seeds_paths)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for name, (method, overrides) in CONFIGURATIONS.items():
            print(f"{name}: method={method} {' '.join(overrides)}".rstrip())
        return 0
    if args.replot:
        try:
            written = replot(Path(args.out).expanduser().resolve())
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("[compare] " + ", ".join(f"{k}: {v}" for k, v in written.items()))
        return 0
    try:
        names = parse_configs(args.configs)
        for key in ("seeds", "steps", "window", "nnodes", "gpus_per_node"):
            if getattr(args, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)}: must be >= 1")
        if args.nnodes > 1 and not args.ray_address:
            raise ValueError(
                f"--nnodes={args.nnodes} needs --ray-address of a cluster with that many nodes "
                f"(on one host: python -m gtpo.cpu.cluster start --nodes {args.nnodes})"
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    earlier = read_earlier_results(out, args.task) if args.resume else {}
    seeds = list(range(args.seeds))
    assets = {s: build_demo_assets(args.cache_dir, seed=s, task=args.task) for s in seeds}
    address = args.ray_address or start_local_ray(args.gpus_per_node)
    t0 = time.monotonic()
    results = {
        "command": "python -m gtpo.cpu.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "task": args.task,
        "steps": args.steps,
        "seeds": seeds,
        "window": args.window,
        "target": args.target,
        "world_size": {"nnodes": args.nnodes, "gpus_per_node": args.gpus_per_node},
        **provenance(assets[seeds[0]].model_dir),
        "configurations": {},
    }
    seeds_paths: list[tuple[str, Path]] = []
    for name in names:
        method, overrides = CONFIGURATIONS[name]
        runs = []
        for seed in seeds:
            run_out = out / name / f"s{seed}"
            summary = finished_run(run_out, method, seed, args.steps) if args.resume else None
            recorded = recorded_run(earlier, name, method, overrides, seed, args.steps) if summary is None else None
            if summary is not None:
                print(f"[compare] {name} s{seed}: kept the finished run in {run_out}", flush=True)
            elif recorded is not None:
                print(f"[compare] {name} s{seed}: kept the run recorded in {out / 'results.json'}", flush=True)
            if recorded is None:
                summary = summary or run_demo(
                    assets[seed], method, args.steps, seed, run_out, list(overrides), timeout=args.timeout,
                    ray_address=address, label=f"{name} s{seed}", plots=False, experiment=f"{name}_s{seed}",
                    nnodes=args.nnodes, gpus_per_node=args.gpus_per_node,
                )  # fmt: skip
            rec = recorded or run_record(run_out / "metrics.jsonl", summary, args.window, args.target)
            runs.append(rec)
            seeds_paths.append((name, series_path(run_out, rec)))
            if rec["returncode"] != 0:
                print(f"[compare] {name} seed {seed} failed (exit {rec['returncode']}); see {run_out / 'train.log'}")
            results["configurations"][name] = {
                "method": method,
                "overrides": list(overrides),
                "runs": runs,
                "aggregate": aggregate(runs, args.steps),
            }
            results["sweep_wall_s"] = round(time.monotonic() - t0, 1)
            # the runs' own wall time, the same whether or not --resume kept some of them
            results["wall_s"] = round(
                sum(r["wall_s"] for c in results["configurations"].values() for r in c["runs"]), 1
            )
            # after every run: a stopped sweep keeps every finished run (the last call wrote the final files)
            written = write_outputs(out, results, seeds_paths)
    print(markdown_table(results))
    listing = ", ".join(f"{k}: {v}" for k, v in written.items())
    print(f"[compare] runs' wall time {results['wall_s'] / 60:.1f} min; {listing}")
    failed = [n for n, c in results["configurations"].items() if c["aggregate"]["runs_complete"] < len(seeds)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
