"""Reshard a verl 0.9.1 FSDP2 checkpoint to another world size, one tensor at a time.

verl's FSDP checkpoint manager (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``) has every rank ``torch.save``
three files into ``actor/`` (and ``critic/``): ``model_world_size_<W>_rank_<r>.pt`` (``model.state_dict()``: one
DTensor per parameter, ``Shard(0)`` on a one-dimensional mesh of the ``W`` ranks, the rank's rows as its local
tensor), ``optim_world_size_<W>_rank_<r>.pt`` (``optimizer.state_dict()``: AdamW's ``exp_avg`` / ``exp_avg_sq``
sharded alike, ``step`` and the parameter groups the same on every rank) and ``extra_state_world_size_<W>_rank_<r>.pt``
(the learning-rate scheduler, the same on every rank, and the rank's RNG states). FSDP2 cuts dimension 0 as
``torch.chunk`` does: rank ``i`` holds rows ``[i·c, min((i+1)·c, n))`` with ``c = ceil(n / W)`` (empty past the end).

:func:`reshard_role` writes the same state for ``W'`` ranks:

* every DTensor is cut again for ``W'`` ranks: the rows of new rank ``j`` are copied from the old ranks' local
  tensors that hold them; the global shape, dtype and placement stay, the mesh becomes one of ``W'`` ranks (its
  device type and dimension name kept);
* everything else (``step``, parameter groups, the scheduler) must be the same in all ``W`` files and is written
  once per new rank; a difference is refused, naming the entry;
* RNG: new rank ``j < W`` keeps old rank ``j``'s states (CPU, NumPy, Python, the accelerator's); a rank ``j >= W``
  (more ranks than before) starts its CPU, NumPy and Python generators from a fresh seed of ``(step, j)`` and keeps
  its accelerator generator as a fresh worker seeds it (verl restores the accelerator's state only when the file
  holds one). Training reads no random numbers on the actor ranks of the recipe's presets (no dropout).

**Memory.** Nothing is held whole. The ``W`` old files are opened with ``torch.load(mmap=True)`` (their tensors are
views of the files, paged in as rows are read and dropped by the kernel under pressure). Each new file is first
written as a skeleton (``torch.serialization.skip_data``: its layout with the tensor bytes left empty, from
``torch.empty`` locals that are never touched), then opened with ``mmap=True`` and ``MAP_SHARED``, and each tensor's
rows are copied from the old mapped rows into the new mapped rows, one tensor at a time. The process allocates no
tensor memory of its own: its anonymous memory stays at the interpreter and the files' small pickled parts whatever
the model's size; the page cache holds what the kernel keeps of the files being read and written. ``time`` is one
read and one write of the checkpoint (``benchmarks/bench_reshard.py``).

**Format.** Only what the module understands is resharded: FSDP2 DTensors on a one-dimensional mesh with
``Shard(0)``. Anything else (FSDP1's ``ShardedTensor``, an HSDP two-dimensional mesh, a tensor whose local rows do
not match ``torch.chunk``'s cut, a rank file missing) raises :class:`ReshardRefused` naming the file and the entry.

    python -m gtpo.trainer.reshard --from <run>/global_step_<N> --world-size 16 [--out <folder>]

rewrites ``global_step_<N>`` in place (:func:`reshard_checkpoint`: a copy beside each role folder, then two
renames; a run killed at any instant leaves the original loadable), or writes a resharded copy of the whole
checkpoint folder to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

from gtpo.trainer.checkpoints import ROLE_DIRS
from gtpo.trainer.reshard_shards import ReshardRefused, fsync, reshard_role, world_size_of

__all__ = [
    "ReshardRefused",
    "finish_interrupted_reshards",
    "main",
    "reshard_checkpoint",
    "reshard_role",
]

NEW_SUFFIX = ".reshard"  # <role>.reshard: the resharded copy being written
OLD_SUFFIX = ".pre-reshard"  # <role>.pre-reshard: the original, between the two renames


# ------------------------------------------------------------------------------------------ in place, recoverable


def _swap_in(folder: str, role: str) -> None:
    """``<role>.reshard`` (complete) replaces ``<role>``: the original is renamed aside first, so an instant without
    ``<role>`` always has ``<role>.pre-reshard`` whole (:func:`finish_interrupted_reshards` puts it back)."""
    role_dir = os.path.join(folder, role)
    os.replace(role_dir, role_dir + OLD_SUFFIX)
    os.replace(role_dir + NEW_SUFFIX, role_dir)
    fsync(folder)
    shutil.rmtree(role_dir + OLD_SUFFIX)


def finish_interrupted_reshards(root_or_folder: str) -> list[str]:
    """Undo what an in-place reshard killed half-way left in ``root_or_folder`` (a checkpoint folder or a run's
    ``default_local_dir``): an original between the two renames goes back to its place, a partial copy is removed,
    an original left after a complete swap is removed. Returns what was done, one line each."""
    folders = [root_or_folder]
    if os.path.isdir(root_or_folder):
        folders += [e.path for e in os.scandir(root_or_folder) if e.is_dir() and e.name.startswith("global_step_")]
    done = []
    for folder in folders:
        for role in ROLE_DIRS:
            role_dir = os.path.join(folder, role)
            if not os.path.lexists(role_dir) and os.path.isdir(role_dir + OLD_SUFFIX):
                os.replace(role_dir + OLD_SUFFIX, role_dir)
                done.append(f"restored {role_dir} from an interrupted reshard")
            for leftover in (role_dir + NEW_SUFFIX, role_dir + OLD_SUFFIX):
                if os.path.isdir(leftover):
                    shutil.rmtree(leftover)
                    done.append(f"removed {leftover}")
    return done


def reshard_checkpoint(folder: str, world_size_to: int, out: str | None = None) -> dict[str, int]:
    """Reshard every role of the checkpoint ``folder`` (``global_step_<N>``) to ``world_size_to`` ranks: in place
    (each role copied beside, then swapped in), or into a copy of the whole folder at ``out``. Roles already at that
    size are left as they are. Returns ``{role: old world size}`` of the roles resharded."""
    folder = os.path.abspath(folder)
    finish_interrupted_reshards(folder)
    named = re.fullmatch(r"global_step_(\d+)", os.path.basename(folder))
    step = int(named.group(1)) if named else 0  # seeds the RNG of ranks beyond the old ones
    if out is not None:
        out = os.path.abspath(out)
        if os.path.lexists(out):
            raise ReshardRefused(f"--out {out} exists; name a new folder")
        partial = out + NEW_SUFFIX
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(folder, partial, symlinks=True, ignore=shutil.ignore_patterns(*ROLE_DIRS))
    resharded = {}
    for role in ROLE_DIRS:
        src = os.path.join(folder, role)
        if not os.path.isdir(src):
            continue
        size = world_size_of(src)
        if out is not None and size == world_size_to:
            shutil.copytree(src, os.path.join(partial, role), symlinks=True)
            continue
        if size == world_size_to:
            continue
        target = src + NEW_SUFFIX if out is None else os.path.join(partial, role)
        shutil.rmtree(target, ignore_errors=True)
        try:
            resharded[role] = reshard_role(src, target, world_size_to, step)
        except BaseException:
            shutil.rmtree(partial if out is not None else target, ignore_errors=True)  # the original is untouched
            raise
        if out is None:
            _swap_in(folder, role)
    if out is not None:
        fsync(partial)
        os.replace(partial, out)
    return resharded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gtpo.trainer.reshard",
        description="Reshard a verl FSDP2 checkpoint folder (global_step_<N>) to another world size.",
    )
    parser.add_argument("--from", dest="folder", required=True, help="the checkpoint folder, global_step_<N>")
    parser.add_argument("--world-size", type=int, required=True, help="the new run's trainer.nnodes x n_gpus_per_node")
    parser.add_argument("--out", default=None, help="write a resharded copy here instead of rewriting --from")
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be >= 1")
    if not os.path.isdir(args.folder):
        parser.error(f"--from {args.folder}: no such folder")
    try:
        done = reshard_checkpoint(args.folder, args.world_size, args.out)
    except ReshardRefused as err:
        print(f"gtpo reshard: refused: {err}", file=sys.stderr)
        return 2
    target = args.out or args.folder
    for role, size in done.items():
        print(f"gtpo reshard: {target}/{role}: world size {size} -> {args.world_size}")
    if not done:
        print(f"gtpo reshard: {target} is already at world size {args.world_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
