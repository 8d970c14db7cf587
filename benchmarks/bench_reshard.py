"""Resharding a checkpoint to another world size: time and peak memory against the checkpoint's size.

A synthetic checkpoint in verl 0.9.1's FSDP2 format (``{model,optim,extra_state}_world_size_<W>_rank_<r>.pt``:
one DTensor per parameter, ``Shard(0)`` over ``W`` ranks, AdamW's two moments alike, float32) of a transformer-shaped
model (embedding and LM head of ``vocab x hidden``, per layer q/k/v/o and the MLP's gate/up/down) is written once;
then each case reshards it (``gtpo.trainer.resume.reshard.reshard_checkpoint(..., out=...)``) in a fresh process that
reports its wall time, its resident-memory high-water mark (``VmHWM``) and the highest anonymous resident memory
sampled every 10 ms (``RssAnon``: what the process allocated, as opposed to the file pages it maps), each above the
same process's level after its imports. ``MB/s`` is the checkpoint's bytes over the time (each byte is read once and
written once).

``--cgroup-limit-mb N`` runs each case in a cgroup v1 memory controller of its own capped at N MB
(``memory.limit_in_bytes``, as a Slurm step's ``--mem`` or a pod's limit is), which is charged for the process's
memory and for the page cache it fills, dirty pages included (root only); the table then adds the cgroup's peak
charge (``memory.max_usage_in_bytes``: resident memory + page cache), the highest dirty page cache sampled every
10 ms (``memory.stat`` ``dirty`` + ``writeback``) and the OOM kills. ``--code DIR`` measures the ``gtpo`` package in
DIR (another checkout, e.g. an earlier commit's ``git archive``) instead of this one.

Usage: .venv/bin/python benchmarks/bench_reshard.py [--hidden 1024 --layers 8 --vocab 32000] [--from 4]
       [--to 2,3,8] [--dir /some/tmp] [--cgroup-limit-mb 512] [--code DIR] [--no-write]
Writes its table into benchmarks/RESULTS.md (section ``reshard``, or ``reshard_cgroup`` with a cgroup limit, or
``--section NAME``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import report  # noqa: E402

_CHILD = r"""
import json, os, re, sys, threading, time

def status(key):
    text = open("/proc/self/status").read()
    return int(re.search(key + r":\s+(\d+)", text).group(1)) / 1024

import torch
from gtpo.trainer.resume.reshard import reshard_checkpoint
import gtpo.trainer.resume.reshard_shards  # noqa: F401
base_rss, base_anon = status("VmRSS"), status("RssAnon")
peak = [base_anon]
done = threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], status("RssAnon"))
        time.sleep(0.01)

threading.Thread(target=sample, daemon=True).start()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
started = time.perf_counter()
reshard_checkpoint(sys.argv[1], int(sys.argv[2]), out=sys.argv[3])
seconds = time.perf_counter() - started
done.set()
peak[0] = max(peak[0], status("RssAnon"))
print(json.dumps({"seconds": seconds, "hwm": status("VmHWM") - base_rss, "anon": peak[0] - base_anon,
                  "base": base_rss}))
"""


def _shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (hidden // 4, hidden),
            p + "self_attn.v_proj.weight": (hidden // 4, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (3 * hidden, hidden), p + "mlp.up_proj.weight": (3 * hidden, hidden),
            p + "mlp.down_proj.weight": (hidden, 3 * hidden), p + "input_layernorm.weight": (hidden,),
        })  # fmt: skip
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _write_checkpoint(actor: Path, shapes: dict[str, tuple[int, ...]], world_size: int) -> int:
    """verl's files at ``world_size`` (random values; the same bytes a training run's would take). Returns bytes."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    actor.mkdir(parents=True)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
    gen = torch.Generator().manual_seed(0)
    for rank in range(world_size):
        mesh = DeviceMesh("cpu", torch.arange(world_size), mesh_dim_names=("fsdp",), _init_backend=False, _rank=rank)

        def local(shape, mesh=mesh, rank=rank):
            per = -(-shape[0] // world_size)
            rows = max(0, min(shape[0], (rank + 1) * per) - min(shape[0], rank * per))
            full = torch.empty(shape)
            meta = TensorMeta(torch.Size(shape), full.stride(), torch.float32)
            spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
            return DTensor(torch.randn((rows, *shape[1:]), generator=gen), spec, requires_grad=False)

        torch.save({n: local(s) for n, s in shapes.items()}, actor / f"model_world_size_{world_size}_rank_{rank}.pt")
        state = {i: {"step": torch.tensor(10.0), "exp_avg": local(s), "exp_avg_sq": local(s)}
                 for i, s in enumerate(shapes.values())}  # fmt: skip
        groups = [{"lr": 1e-6, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(state)}]
        torch.save({"state": state, "param_groups": groups}, actor / f"optim_world_size_{world_size}_rank_{rank}.pt")
        extra = {"lr_scheduler": {"last_epoch": 10}, "rng": {"cpu": torch.get_rng_state()}}
        torch.save(extra, actor / f"extra_state_world_size_{world_size}_rank_{rank}.pt")
    return sum(p.stat().st_size for p in actor.iterdir() if p.is_file())


CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def _run_in_cgroup(cmd: list[str], env: dict, limit_mb: int, cwd: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """``cmd`` in a fresh memory cgroup capped at ``limit_mb``: its result and the cgroup's peaks."""
    group = CGROUP_ROOT / f"gtpo-bench-reshard-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_mb * 2**20))
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        proc = subprocess.Popen(["sh", "-c", join, "sh", *cmd], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        dirty = 0
        while proc.poll() is None:
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
            dirty = max(dirty, int(stat.get("dirty", 0)) + int(stat.get("writeback", 0)))
            time.sleep(0.01)
        out, err = proc.communicate()
        oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        peaks = {
            "charged": int((group / "memory.max_usage_in_bytes").read_text()) / 2**20,
            "dirty": dirty / 2**20,
            "oom_kills": int(oom.get("oom_kill", 0)),
        }
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err), peaks
    finally:
        for _ in range(100):  # the killed or exited process leaves the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--from", dest="world_size_from", type=int, default=4)
    parser.add_argument("--to", default="2,3,8")
    parser.add_argument("--dir", default=None, help="a folder on the disk to measure (default: the system's temp)")
    parser.add_argument("--cgroup-limit-mb", type=int, default=None, help="run each case in a memory cgroup this size")
    parser.add_argument("--code", default=str(Path(__file__).resolve().parents[1]), help="the checkout to measure")
    parser.add_argument("--section", default=None, help="the RESULTS.md section to write (default by the options)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    shapes = _shapes(args.hidden, args.layers, args.vocab)
    params = sum(_numel(s) for s in shapes.values())
    largest_mb = max(_numel(s) for s in shapes.values()) * 4 / 2**20
    work = Path(tempfile.mkdtemp(prefix="gtpo-reshard-bench-", dir=args.dir))
    try:
        source = work / "global_step_10"
        size = _write_checkpoint(source / "actor", shapes, args.world_size_from)
        rows = []
        for world_size_to in [int(w) for w in args.to.split(",")]:
            out = work / f"to{world_size_to}"
            env = {
                **os.environ,
                "PYTHONPATH": args.code,
            }  # run from `work`: the checkout's own folder is not on the path
            cmd = [sys.executable, "-c", _CHILD, str(source), str(world_size_to), str(out)]
            if args.cgroup_limit_mb is None:
                proc, peaks = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work), None
            else:
                proc, peaks = _run_in_cgroup(cmd, env, args.cgroup_limit_mb, work)
            row = f"| {args.world_size_from} -> {world_size_to} | {size / 2**20:.0f} | {largest_mb:.0f} | "
            if proc.returncode == 0:
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                row += (f"{result['seconds']:.1f} | {2 * size / 2**20 / result['seconds']:.0f} | {result['hwm']:.0f} | "
                        f"{result['anon']:.0f} |")  # fmt: skip
            elif peaks is None:
                raise RuntimeError(f"the reshard failed: {proc.stderr[-2000:]}")
            else:
                row += f"failed (exit {proc.returncode}) | | | |"
            if peaks is not None:
                row += (
                    f" {args.cgroup_limit_mb} | {peaks['charged']:.0f} | {peaks['dirty']:.0f} | {peaks['oom_kills']} |"
                )
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    columns = (
        "| W -> W' | checkpoint MB | largest tensor MB | seconds | MB/s (read + write) | peak RSS MB | "
        "peak anonymous MB |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if args.cgroup_limit_mb is not None:
        columns += " cgroup limit MB | peak charged MB (RSS + page cache) | peak dirty MB | OOM kills |"
        rule += "---:|---:|---:|---:|"
    text = (
        f"Model: {params / 1e6:.0f} M float32 parameters (hidden {args.hidden}, {args.layers} layers, vocabulary "
        f"{args.vocab}); checkpoint = parameters + AdamW's two moments = 12 B per parameter; temp folder on "
        f"{_filesystem(args.dir)}; code: {_describe_code(args.code)}.\n\n"
        + columns
        + "\n"
        + rule
        + "\n"
        + "\n".join(rows)
        + "\n"
    )
    section = args.section or ("reshard" if args.cgroup_limit_mb is None else "reshard_cgroup")
    title = "Reshard a checkpoint to another world size" + (" under a memory cgroup" if args.cgroup_limit_mb else "")
    report(section, title + (f" ({args.section})" if args.section else ""), text, write=not args.no_write)


def _describe_code(code: str) -> str:
    """The commit of the checkout measured (``git describe`` or the archive's recorded commit)."""
    recorded = Path(code) / ".commit"
    if recorded.is_file():
        return f"commit {recorded.read_text().strip()[:12]} ({code})"
    try:
        out = subprocess.run(["git", "-C", code, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", code, "status", "--porcelain", "gtpo"], capture_output=True, text=True)
    except OSError:
        return code
    if out.returncode != 0:
        return code
    return f"commit {out.stdout.strip()}" + (" + uncommitted changes" if dirty.stdout.strip() else "")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _filesystem(folder: str | None) -> str:
    path = folder or tempfile.gettempdir()
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, timeout=10).stdout.splitlines()
        return f"{path} ({out[-1].split()[1]})"
    except (OSError, IndexError, subprocess.SubprocessError):
        return path


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s in all)")
