"""Training phases of verl's real actor worker that save, load and continue from FSDP2 checkpoints, for
``tests/test_reshard_dp.py``.

A :class:`Phase` is one life of ``world_size`` gloo rank processes (no Ray), each building verl 0.9.1's
``ActorRolloutRefWorker`` (FSDP2 engine) from the recipe's composed config as ``tests/support/dp.py`` does, with
AdamW and a warm-up + cosine learning-rate schedule instead of that harness's SGD. Each rank optionally loads a
checkpoint with the worker's ``load_checkpoint`` (what ``PPOTrainer._load_checkpoint`` calls on the worker group),
runs ``update_actor`` on its chunk of one fixed driver batch once per step, and optionally saves with the worker's
``save_checkpoint(<root>/global_step_<N>/actor, global_step=N)`` (what ``PPOTrainer._save_checkpoint`` calls).
Rank 0 reports the driver's reduction of each update's metrics, the full weights after each update, and the full
training state (weights, both AdamW moments, the optimizer's step, the scheduler's position) after a load and at a
save.

:func:`killed_reshard` runs ``gtpo.trainer.resume.reshard.reshard_checkpoint`` in a child process that ``SIGKILL``s
itself at a chosen instant: after its first new file, between the two renames of the swap, or after the swap before
the original is removed.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.support import dp as S

REPO_ROOT = Path(__file__).resolve().parents[2]

METHOD = "gtpo"  # the recipe's estimator with verl's clipped loss, installed as AdvantageHandoff.on_init_end does
LR = 1e-3
WEIGHT_DECAY = 0.01
WARMUP_STEPS = 2
TOTAL_STEPS = 5
# verl's cosine schedule with warm-up, counted from 1 (zero_indexed_step=false): the lr factor of update k (1-based)
# is k / WARMUP_STEPS while k < WARMUP_STEPS, then 0.5 * (1 + cos(pi * (k - WARMUP_STEPS) / (TOTAL - WARMUP))).
ADAMW = {
    "optimizer": "AdamW",
    "lr": LR,
    "weight_decay": WEIGHT_DECAY,
    "lr_scheduler_type": "cosine",
    "lr_warmup_steps": WARMUP_STEPS,
    "total_training_steps": TOTAL_STEPS,
    "zero_indexed_step": False,
    "min_lr_ratio": 0.0,
}
ALL_CONTENTS = ("model", "optimizer", "extra")


def actor_config(model_dir: Path | str, load_contents: tuple[str, ...] = ALL_CONTENTS):
    """:func:`tests.support.dp.compose_config`'s config for :data:`METHOD` (padded path, micro-batches of 4 rows, no
    clipping in effect) with AdamW and the warm-up + cosine schedule of :data:`ADAMW`."""
    cfg = S.compose_config(METHOD, model_dir)
    for key, value in ADAMW.items():
        cfg.actor_rollout_ref.actor.optim[key] = value
    cfg.actor_rollout_ref.actor.checkpoint.load_contents = list(load_contents)
    return cfg


def checkpoint_dir(root: Path | str, step: int) -> Path:
    """verl's ``<default_local_dir>/global_step_<N>``."""
    return Path(root) / f"global_step_{step}"


@dataclass
class Phase:
    """One life of the worker ranks: load (optional), one update per entry of ``steps``, save after ``save_at``."""

    world_size: int
    model_dir: str
    rows_by_rank: list[list[dict]]  # each rank's chunk of the fixed driver batch for this world size
    nested: set[str]
    extra_info: dict
    steps: tuple[int, ...]  # the global step number of each update
    root: str  # default_local_dir: checkpoints go to <root>/global_step_<N>/actor
    load_step: int | None = None
    save_at: int | None = None
    load_contents: tuple[str, ...] = ALL_CONTENTS


@dataclass
class PhaseResult:
    """Rank 0's report of one :class:`Phase`."""

    metrics: dict[int, dict] = field(default_factory=dict)  # step -> "actor/..." metrics of that update
    weights: dict[int, dict] = field(default_factory=dict)  # step -> full parameters after that update
    loaded: dict | None = None  # the training state right after the load
    saved: dict | None = None  # the training state at the save
    seconds: float = 0.0


def phase(world_size: int, batch: S.DriverBatch, model_dir: Path, root: Path, steps, **kwargs) -> Phase:
    """A :class:`Phase` training on ``batch`` (the driver batch for ``world_size``, cut into its ranks' chunks)."""
    assert batch.dp == world_size
    return Phase(
        world_size=world_size,
        model_dir=str(model_dir),
        rows_by_rank=[batch.rank_rows(r) for r in range(world_size)],
        nested=batch.nested,
        extra_info=batch.extra_info,
        steps=tuple(steps),
        root=str(root),
        **kwargs,
    )


def training_state(engine) -> dict:
    """Full parameters, AdamW moments and steps by parameter name, and the scheduler's position (collective)."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().cpu()

    names = {p: n for n, p in engine.module.named_parameters()}
    state = {"params": S._full_state(engine.module), "exp_avg": {}, "exp_avg_sq": {}, "step": {}}
    for p, opt_state in engine.optimizer.state.items():
        state["exp_avg"][names[p]] = full(opt_state["exp_avg"])
        state["exp_avg_sq"][names[p]] = full(opt_state["exp_avg_sq"])
        state["step"][names[p]] = float(opt_state["step"])
    state["last_epoch"] = engine.lr_scheduler.last_epoch
    state["lr"] = engine.lr_scheduler.get_last_lr()[0]
    return state


def _update(worker, data) -> dict:
    """verl's ``update_actor`` and ``PPOTrainer._update_actor``'s reduction of its metrics (rank 0's output)."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    out = worker.update_actor(data)
    if out is None:
        return {}
    metrics = rename_dict(dict(out["metrics"]), "actor/")
    metrics.pop("actor/mfu", None)
    return {k: float(v) for k, v in reduce_metrics(metrics).items() if S._is_number(v)}


def _run_phase(job: Phase, rank: int) -> PhaseResult:
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from gtpo.verl_plugin import actor_loss

    started = time.perf_counter()
    cfg = actor_config(job.model_dir, job.load_contents)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    actor_loss.install(SimpleNamespace(config=cfg, actor_rollout_wg=worker))  # as AdvantageHandoff.on_init_end does
    engine = worker.actor.engine
    result = PhaseResult()
    if job.load_step is not None:
        worker.load_checkpoint(str(checkpoint_dir(job.root, job.load_step) / "actor"), del_local_after_load=False)
        result.loaded = training_state(engine)
    for step in job.steps:
        result.metrics[step] = _update(worker, S.worker_input(job.rows_by_rank[rank], job.nested, job.extra_info))
        result.weights[step] = S._full_state(engine.module)
        if step == job.save_at:
            worker.save_checkpoint(str(checkpoint_dir(job.root, step) / "actor"), global_step=step)
            result.saved = training_state(engine)
    result.seconds = time.perf_counter() - started
    return result


def _rank_main(rank: int, world_size: int, port: int, job_path: str, out_dir: str) -> None:
    S.rank_environment(rank, world_size, port)
    try:
        import verl  # noqa: F401 - loads the CPU platform and the recipe's registrations

        result = _run_phase(torch.load(job_path, weights_only=False), rank)
        if rank == 0:
            torch.save(result, Path(out_dir) / "rank0.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def run_phase(job: Phase, folder: Path, timeout: float = 600) -> PhaseResult:
    """Run ``job`` on ``job.world_size`` spawned gloo ranks; rank 0's report (``folder``: the job and report)."""
    import multiprocessing

    folder.mkdir(parents=True)
    job_path = folder / "job.pt"
    torch.save(job, job_path)
    ctx = multiprocessing.get_context("spawn")
    port = S._free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, job.world_size, port, str(job_path), str(folder)), daemon=True)
        for r in range(job.world_size)
    ]
    for p in procs:
        p.start()
    S.wait_processes({job.world_size: procs}, lambda _: folder, timeout)
    return torch.load(folder / "rank0.pt", weights_only=False)


# ------------------------------------------------------------------------------------------------ killed reshards

_KILLED = """
import os, shutil, signal, sys
import gtpo.trainer.resume.reshard as reshard
import gtpo.trainer.resume.reshard_shards as shards

folder, world_size, at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real_fsync, real_replace, real_rmtree = shards.fsync, os.replace, shutil.rmtree

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def fsync(path):  # the first new file written and synced, nothing else yet
    real_fsync(path)
    die()

def replace(src, dst):  # the original moved aside, the new copy not yet in its place
    if str(src).endswith(reshard.NEW_SUFFIX):
        die()
    real_replace(src, dst)

def rmtree(path, *args, **kwargs):  # the new copy in place, the original not yet removed
    if str(path).endswith(reshard.OLD_SUFFIX):
        die()
    real_rmtree(path, *args, **kwargs)

if at == "after_first_file":
    shards.fsync = fsync
elif at == "between_renames":
    os.replace = replace
elif at == "before_cleanup":
    shutil.rmtree = rmtree
else:
    raise SystemExit(f"unknown kill point {at}")
reshard.reshard_checkpoint(folder, world_size)
"""
KILL_POINTS = ("after_first_file", "between_renames", "before_cleanup")


def killed_reshard(folder: Path, world_size: int, at: str) -> None:
    """``reshard_checkpoint(folder, world_size)`` in a child process killed with ``SIGKILL`` at ``at`` (one of
    :data:`KILL_POINTS`); raises if the child was not killed there."""
    assert at in KILL_POINTS
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, str(folder), str(world_size), at],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"the reshard was not killed at {at}: rc {proc.returncode}\n{proc.stderr}"
    )


def hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory`` by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }
