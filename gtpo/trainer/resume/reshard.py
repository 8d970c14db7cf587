"""Reshard a verl 0.9.1 FSDP2 checkpoint folder to another world size, in place and recoverably, or into a copy.

    python -m gtpo.trainer.resume.reshard --from <run>/global_step_<N> --world-size 16 [--out <folder>]

:func:`reshard_checkpoint` rewrites each role folder (``actor/``, ``critic/``) of ``global_step_<N>`` with
:func:`gtpo.trainer.resume.reshard_shards.reshard_role` (the file format, the RNG of new ranks and the memory bound
are described there) into ``<role>.reshard`` beside it, then swaps it in with two renames, so a run killed at any
instant leaves the original loadable (:func:`finish_interrupted_reshards`, run by every resume, puts it back);
``--out`` writes a resharded copy of the whole checkpoint folder instead. The resume calls it when a checkpoint's
world size differs from the run's (:mod:`gtpo.trainer.resume.checkpoint_world_size`). Nothing is read or renamed in
a checkpoint that others could have written into (a symlink, a file or folder of another user's or writable by group
or others), and every shard is read as data only (:mod:`gtpo.trainer.resume.loads`); the command writes under
``umask 077``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

from gtpo.private_files import check_private_tree
from gtpo.trainer.resume.checkpoints import ROLE_DIRS
from gtpo.trainer.resume.reshard_shards import ReshardRefused, fsync, reshard_role, world_size_of

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
    size are left as they are. Returns ``{role: old world size}`` of the roles resharded.

    Raises:
        ReshardRefused: a folder or file in ``folder`` others could have written
            (:func:`gtpo.private_files.check_private_tree`), or a format it does not understand.
    """
    folder = os.path.abspath(folder)
    try:  # before anything in it is renamed or read: torch.load of a file others wrote runs their code
        check_private_tree(folder, "the checkpoint")
    except OSError as err:
        raise ReshardRefused(str(err)) from None
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
        prog="python -m gtpo.trainer.resume.reshard",
        description="Reshard a verl FSDP2 checkpoint folder (global_step_<N>) to another world size.",
    )
    parser.add_argument("--from", dest="folder", required=True, help="the checkpoint folder, global_step_<N>")
    parser.add_argument("--world-size", type=int, required=True, help="the new run's trainer.nnodes x n_gpus_per_node")
    parser.add_argument("--out", default=None, help="write a resharded copy here instead of rewriting --from")
    args = parser.parse_args(argv)
    os.umask(0o077)  # the resharded files and --out are the user's alone, as the launchers' checkpoints are
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
