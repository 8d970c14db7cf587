"""The shard files of one role folder of a verl 0.9.1 FSDP2 checkpoint, cut again for another world size
(:func:`reshard_role`; :mod:`gtpo.trainer.resume.reshard` puts the result in place).

verl's FSDP checkpoint manager (``verl/utils/checkpoint/fsdp_checkpoint_manager.py``) has every rank ``torch.save``
three files into ``actor/`` (and ``critic/``): ``model_world_size_<W>_rank_<r>.pt`` (``model.state_dict()``: one
DTensor per parameter, ``Shard(0)`` on a one-dimensional mesh of the ``W`` ranks, the rank's rows as its local
tensor), ``optim_world_size_<W>_rank_<r>.pt`` (``optimizer.state_dict()``: AdamW's ``exp_avg`` / ``exp_avg_sq``
sharded alike, ``step`` and the parameter groups the same on every rank) and ``extra_state_world_size_<W>_rank_<r>.pt``
(the learning-rate scheduler, the same on every rank, and the rank's RNG states). FSDP2 cuts dimension 0 as
``torch.chunk`` does: rank ``i`` holds rows ``[i·c, min((i+1)·c, n))`` with ``c = ceil(n / W)`` (empty past the end).

Resharding writes the same state for ``W'`` ranks:

* every DTensor is cut again for ``W'`` ranks: the rows of new rank ``j`` are copied from the old ranks' local
  tensors that hold them; the global shape, dtype and placement stay, the mesh becomes one of ``W'`` ranks (its
  device type and dimension name kept);
* everything else (``step``, parameter groups, the scheduler) must be the same in all ``W`` files and is written
  once per new rank; a difference is refused, naming the entry;
* RNG: new rank ``j < W`` keeps old rank ``j``'s states (CPU, NumPy, Python, the accelerator's); a rank ``j >= W``
  (more ranks than before) starts its CPU, NumPy and Python generators from a fresh seed of ``(step, j)`` and keeps
  its accelerator generator as a fresh worker seeds it (verl restores the accelerator's state only when the file
  holds one). Training reads no random numbers on the actor ranks of the recipe's presets (no dropout).

**Memory.** Nothing is held whole. The ``W`` old files are opened with ``torch.load(mmap=True)``, each checked right
before and read as data only (:mod:`gtpo.trainer.resume.loads`); their tensors are views of the files, paged in as
rows are read and dropped by the kernel under pressure. Each new file is first
written as a skeleton (``torch.serialization.skip_data``: its layout with the tensor bytes left empty, from
``torch.empty`` locals that are never touched), then opened with ``mmap=True`` and ``MAP_SHARED``, and each tensor's
rows are copied from the old mapped rows into the new mapped rows, one tensor at a time. The process allocates no
tensor memory of its own: its anonymous memory stays at the interpreter and the files' small pickled parts whatever
the model's size; the page cache holds what the kernel keeps of the files being read and written. Rows are copied
in slices of at most :data:`WRITEBACK_BYTES`, each written back to the file (``sync_file_range``) and dropped from
the page cache (``posix_fadvise(DONTNEED)``) on a thread of its own while the next slice is copied: the dirty pages,
which a memory-capped Slurm step or pod is charged for and cannot reclaim without writing them, stay below three
slices whatever the size of a file (a 16 GB optimizer shard of 32B at 16 ranks was one file of dirty pages until its
``fsync``). ``time`` is one read and one
write of the checkpoint (``benchmarks/bench_reshard.py``, which also measures the peak under a memory cgroup).

**Format.** Only what the module understands is resharded: FSDP2 DTensors on a one-dimensional mesh with
``Shard(0)``. Anything else (FSDP1's ``ShardedTensor``, an HSDP two-dimensional mesh, a tensor whose local rows do
not match ``torch.chunk``'s cut, a rank file missing) raises :class:`ReshardRefused` naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import queue
import random
import shutil
import sys
import threading
from typing import Any

from gtpo.trainer.resume.checkpoints import SHARD_KINDS, role_world_size, shard_files, shard_name
from gtpo.trainer.resume.loads import load_checkpoint_file

__all__ = ["FSDP_CONFIG", "WRITEBACK_BYTES", "ReshardRefused", "fsync", "reshard_role", "shard_names_of",
           "world_size_of"]  # fmt: skip

FSDP_CONFIG = "fsdp_config.json"  # verl's record of the FSDP version and world size
# Bytes of a new file copied between two write-backs: the dirty pages of a reshard stay below this.
WRITEBACK_BYTES = 64 * 2**20


class ReshardRefused(RuntimeError):
    """The checkpoint cannot be resharded; the message names the file and why."""


def world_size_of(directory: str) -> int | None:
    """:func:`gtpo.trainer.resume.checkpoints.role_world_size`, a mix of sizes refused as what cannot be resharded."""
    try:
        return role_world_size(directory)
    except ValueError as err:
        raise ReshardRefused(str(err)) from None


def _chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of dimension 0 that ``rank`` of ``world_size`` holds under ``torch.chunk``'s cut."""
    per_rank = math.ceil(rows / world_size) if rows else 0
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


# ---------------------------------------------------------------------------------------------- the file format


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _check_dtensor(value: Any, where: str, world_size: int, rank: int) -> None:
    from torch.distributed.tensor import Shard

    mesh = value.device_mesh
    if mesh.ndim != 1 or mesh.size() != world_size or tuple(value.placements) != (Shard(0),):
        raise ReshardRefused(
            f"{where}: a DTensor on mesh {tuple(mesh.shape)} with placements {tuple(value.placements)}; resharding "
            f"reads FSDP2's one-dimensional mesh of the {world_size} ranks with Shard(0) (an HSDP run, "
            "fsdp_config.fsdp_size < world size, is not supported)"
        )
    if value.dim() == 0:
        raise ReshardRefused(f"{where}: a zero-dimensional DTensor cannot be cut along dimension 0")
    start, end = _chunk_rows(value.shape[0], world_size, rank)
    local = value._local_tensor  # to_local() would dispatch through DTensor; the rows as saved
    if tuple(local.shape) != (end - start, *value.shape[1:]):
        raise ReshardRefused(
            f"{where}: rank {rank} holds local rows of shape {tuple(local.shape)} where torch.chunk's cut of "
            f"{tuple(value.shape)} over {world_size} ranks gives {(end - start, *value.shape[1:])}"
        )


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and bool(torch.equal(a, b))
        )  # fmt: skip
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _new_mesh(old_mesh: Any, world_size: int, rank: int) -> Any:
    """A mesh of ``world_size`` ranks as seen by ``rank``, with the old one's device type and dimension name; no
    process group is created (``_init_backend=False``), the loading rank's own mesh is what it is compared with."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(
        old_mesh.device_type, torch.arange(world_size), mesh_dim_names=old_mesh.mesh_dim_names,
        _init_backend=False, _rank=rank,
    )  # fmt: skip
    if hasattr(old_mesh, "_dim_group_names"):
        mesh._dim_group_names = list(old_mesh._dim_group_names)  # the names a loading rank's groups resolve by
    return mesh


def _skeleton(value: Any, meshes: dict, world_size: int, rank: int) -> Any:
    """``value`` (rank 0's entry) as new rank ``rank`` stores it, DTensor locals as untouched ``torch.empty``."""
    import torch
    from torch.distributed.tensor import DTensor

    if _is_dtensor(value):
        start, end = _chunk_rows(value.shape[0], world_size, rank)
        local = torch.empty((end - start, *value.shape[1:]), dtype=value.dtype)
        key = id(value.device_mesh)
        if key not in meshes:
            meshes[key] = _new_mesh(value.device_mesh, world_size, rank)
        spec = dataclasses.replace(value._spec, mesh=meshes[key])
        return DTensor(local, spec, requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="cpu")
    if isinstance(value, dict):
        return {k: _skeleton(v, meshes, world_size, rank) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_skeleton(v, meshes, world_size, rank) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _check_structure(olds: list[Any], where: str, world_size: int) -> None:
    """Every rank's entry a DTensor of the same global shape cut as FSDP2 cuts it, or the same value everywhere."""
    import torch

    first = olds[0]
    if _is_dtensor(first):
        for rank, value in enumerate(olds):
            if not _is_dtensor(value) or value.shape != first.shape or value.dtype != first.dtype:
                raise ReshardRefused(f"{where}: rank {rank}'s entry is not rank 0's DTensor {tuple(first.shape)}")
            _check_dtensor(value, f"{where} (rank {rank})", world_size, rank)
        return
    if type(first).__name__ == "ShardedTensor":
        raise ReshardRefused(f"{where}: an FSDP1 ShardedTensor; resharding reads FSDP2 checkpoints (strategy=fsdp2)")
    if isinstance(first, dict):
        for rank, value in enumerate(olds):
            if not isinstance(value, dict) or value.keys() != first.keys():
                raise ReshardRefused(f"{where}: rank {rank} holds other entries than rank 0")
        for key in first:
            _check_structure([value[key] for value in olds], f"{where}[{key!r}]", world_size)
        return
    if isinstance(first, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in first):
        for rank, value in enumerate(olds):
            if type(value) is not type(first) or len(value) != len(first):
                raise ReshardRefused(f"{where}: rank {rank} holds another sequence than rank 0")
        for i in range(len(first)):
            _check_structure([value[i] for value in olds], f"{where}[{i}]", world_size)
        return
    for rank, value in enumerate(olds[1:], start=1):
        if not _same(first, value):
            raise ReshardRefused(f"{where}: rank {rank}'s value differs from rank 0's; only sharded entries may")


def _fill(new: Any, olds: list[Any], world_size_from: int, world_size_to: int, rank: int, written=None) -> None:
    """Copy into ``new`` (the mapped skeleton of new rank ``rank``) its rows from the old ranks' mapped entries, in
    slices of at most :data:`WRITEBACK_BYTES`, each handed to ``written`` (:class:`_WriteBack`) once copied."""
    import torch

    written = written or (lambda mapped: None)
    if _is_dtensor(new):
        rows = new.shape[0]
        start, end = _chunk_rows(rows, world_size_to, rank)
        target = new._local_tensor
        row_bytes = max(target[:1].numel() * target.element_size(), 1)
        step = max(WRITEBACK_BYTES // row_bytes, 1)
        for old_rank, old in enumerate(olds):
            old_start, old_end = _chunk_rows(rows, world_size_from, old_rank)
            for lo in range(max(start, old_start), min(end, old_end), step):
                hi = min(lo + step, end, old_end)
                rows_read = old._local_tensor[lo - old_start : hi - old_start]
                target[lo - start : hi - start].copy_(rows_read)
                _release(rows_read)
                written(target[lo - start : hi - start])
        _release(target)
    elif isinstance(new, torch.Tensor):
        new.copy_(olds[0])
        written(new)
    elif isinstance(new, dict):
        for key in new:
            _fill(new[key], [old[key] for old in olds], world_size_from, world_size_to, rank, written)
    elif isinstance(new, (list, tuple)):
        for i, item in enumerate(new):
            _fill(item, [old[i] for old in olds], world_size_from, world_size_to, rank, written)


# sync_file_range's SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER (Linux <fcntl.h>)
_SYNC_FILE_RANGE = 1 | 2 | 4


class _WriteBack:
    """Writes the rows just copied into a new file's ``MAP_SHARED`` mapping back to the file (``sync_file_range``)
    and drops them from the page cache, on a thread of its own while the next slice is copied (the call and torch's
    copy both release the GIL): a new file's dirty pages never exceed three slices of :func:`_fill` (one being
    written, one queued, one being copied)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)
        self._base = _mapped_at(path)  # where torch mapped the file: a slice's address gives its file offset
        self._slices: queue.Queue = queue.Queue(maxsize=1)
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="gtpo-reshard-writeback", daemon=True)
        self._thread.start()

    def __call__(self, mapped: Any) -> None:
        if self._error is not None:
            raise self._error
        self._slices.put(mapped)

    def _run(self) -> None:
        while (mapped := self._slices.get()) is not None:
            if self._error is None:
                try:
                    self._flush(mapped)
                except OSError as err:
                    self._error = err

    def _flush(self, mapped: Any) -> None:
        import ctypes
        import mmap

        nbytes = mapped.numel() * mapped.element_size()
        if not nbytes or not sys.platform.startswith("linux"):
            return
        _release(mapped)  # unmapped pages keep their data in the page cache, dirty until written
        page = mmap.PAGESIZE
        start = mapped.data_ptr() // page * page
        end = -(-(mapped.data_ptr() + nbytes) // page) * page
        offset, length = (start - self._base, end - start) if self._base is not None else (0, 0)
        # written and waited for, without the journal commit an msync or fsync would force; then only these pages
        # leave the page cache (the skeleton's pages still to be filled stay, or each would be read back from disk)
        args = (self.fd, ctypes.c_longlong(offset), ctypes.c_longlong(length), _SYNC_FILE_RANGE)
        if _libc().sync_file_range(*args) != 0:
            raise OSError(ctypes.get_errno(), "writing back a resharded file's rows failed")
        if self._base is not None:
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self._slices.put(None)
        self._thread.join()
        os.close(self.fd)
        if self._error is not None:
            raise self._error


def _mapped_at(path: str) -> int | None:
    """The address at which this process maps ``path`` from its first byte (``/proc/self/maps``), or None."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() == real and int(fields[2], 16) == 0:
                    return int(fields[0].split("-")[0], 16)
    except OSError:
        pass
    return None


def _drop_cached(paths: list[str]) -> None:
    """Drop the old files' clean pages from the page cache (read once; charged to the job's memory otherwise)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_MADV_DONTNEED = 4  # Linux <sys/mman.h>


def _release(mapped: Any) -> None:
    """Drop the pages of a tensor that lives in a file mapping from this process's resident set (``madvise
    MADV_DONTNEED``): the old files' pages are clean (mapped read-only, re-read if touched again), the new files' are
    in the page cache (``MAP_SHARED``), so nothing is lost, and the resident memory stays at one tensor's rows. Only
    for tensors of :func:`_load_mapped` / the ``MAP_SHARED`` skeleton; a failed call changes nothing but memory."""
    import ctypes
    import mmap

    nbytes = mapped.numel() * mapped.element_size()
    if not nbytes or not sys.platform.startswith("linux"):
        return
    page = mmap.PAGESIZE
    start = mapped.data_ptr() // page * page
    end = -(-(mapped.data_ptr() + nbytes) // page) * page
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _load_mapped(path: str) -> Any:
    """``path`` memory-mapped, checked and read as data only (:func:`.loads.load_checkpoint_file`)."""
    try:
        return load_checkpoint_file(path, "a shard file")
    except PermissionError as err:  # others could have written it: refused before anything is read
        raise ReshardRefused(str(err)) from None
    except Exception as err:  # a truncated or foreign file, or one holding more than data: name it
        raise ReshardRefused(f"{path}: cannot be read as a torch.save file ({type(err).__name__}: {err})") from None


def fsync(path: str) -> None:
    """Flush ``path`` (a file or a folder) to disk; a file's pages then leave the page cache too (the reshard reads
    and writes each byte once)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if os.path.isfile(path) and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _reshard_sharded_kind(src: str, dst: str, kind: str, world_size_from: int, world_size_to: int) -> None:
    """``model`` or ``optim``: the W old files mapped read-only, each new file a skeleton filled in place."""
    import mmap

    import torch

    old_paths = [os.path.join(src, shard_name(kind, world_size_from, r)) for r in range(world_size_from)]
    olds = [_load_mapped(path) for path in old_paths]
    _check_structure(olds, f"{src}/{shard_name(kind, world_size_from, 0)}", world_size_from)
    for rank in range(world_size_to):
        path = os.path.join(dst, shard_name(kind, world_size_to, rank))
        with torch.serialization.skip_data():
            torch.save(_skeleton(olds[0], {}, world_size_to, rank), path)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            new = load_checkpoint_file(path, "a new shard file")
        written = _WriteBack(path)
        try:
            _fill(new, olds, world_size_from, world_size_to, rank, written)
        finally:
            written.close()
        del new  # unmaps; the written pages are the file's
        fsync(path)
        _drop_cached(old_paths)


def _fresh_rng(rng: dict, step: int, rank: int) -> dict:
    """CPU, NumPy and Python generator states seeded from ``(step, rank)``, in verl's ``get_rng_state`` layout; the
    accelerator's state is left out (verl then keeps the worker's own)."""
    import numpy as np
    import torch

    seed = int.from_bytes(hashlib.sha256(f"gtpo-reshard:{step}:{rank}".encode()).digest()[:4], "little")
    fresh = {"cpu": torch.Generator().manual_seed(seed).get_state()}
    if "numpy" in rng:
        fresh["numpy"] = np.random.RandomState(seed).get_state()
    if "random" in rng:
        fresh["random"] = random.Random(seed).getstate()
    return fresh


def _reshard_extra(src: str, dst: str, world_size_from: int, world_size_to: int, step: int) -> None:
    import torch

    olds = [
        _load_mapped(os.path.join(src, shard_name("extra_state", world_size_from, r))) for r in range(world_size_from)
    ]
    where = f"{src}/{shard_name('extra_state', world_size_from, 0)}"
    if not all(isinstance(o, dict) for o in olds) or any(o.keys() != olds[0].keys() for o in olds):
        raise ReshardRefused(f"{where}: the ranks' extra states hold different entries")
    shared = {k: v for k, v in olds[0].items() if k != "rng"}
    _check_structure([{k: v for k, v in o.items() if k != "rng"} for o in olds], where, world_size_from)
    for rank in range(world_size_to):
        state = dict(shared)
        if "rng" in olds[0]:
            state["rng"] = olds[rank]["rng"] if rank < world_size_from else _fresh_rng(olds[0]["rng"], step, rank)
        path = os.path.join(dst, shard_name("extra_state", world_size_to, rank))
        torch.save(state, path)
        fsync(path)


def _copy_others(src: str, dst: str, world_size_to: int) -> None:
    """What ``src`` holds besides shard files (``huggingface/``, ``fsdp_config.json`` with the new world size)."""
    shards = shard_names_of(src)
    for entry in os.scandir(src):
        if entry.name in shards:
            continue
        target = os.path.join(dst, entry.name)
        if entry.name == FSDP_CONFIG:
            with open(entry.path) as f:
                config = json.load(f)
            config["world_size"] = world_size_to
            with open(target, "w") as f:
                json.dump(config, f, indent=4)
        elif entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, target, symlinks=True)
        else:
            shutil.copy2(entry.path, target, follow_symlinks=False)


def shard_names_of(directory: str) -> set[str]:
    """The names of the shard files in ``directory``."""
    return {shard_name(k, w, r) for w, files in shard_files(directory).items() for k, r in files}


def reshard_role(src: str, dst: str, world_size_to: int, step: int = 0) -> int:
    """Write into the new folder ``dst`` the role folder ``src`` (``actor/`` or ``critic/``) resharded to
    ``world_size_to`` ranks; returns the old world size. ``step`` seeds the RNG of ranks beyond the old ones.

    Raises:
        ReshardRefused: a format not understood, a rank's file missing (nothing is written then but ``dst``).
    """
    world_size_from = world_size_of(src)
    if world_size_from is None:
        raise ReshardRefused(f"{src} holds no shard files of verl's FSDP checkpoint")
    files = shard_files(src)[world_size_from]
    kinds = [k for k in SHARD_KINDS if any(kind == k for kind, _ in files)]
    for kind in kinds:
        missing = [r for r in range(world_size_from) if (kind, r) not in files]
        if missing:
            raise ReshardRefused(f"{src}: {shard_name(kind, world_size_from, missing[0])} is missing")
    _check_fsdp_version(src)
    os.makedirs(dst, mode=0o700)
    for kind in kinds:
        if kind == "extra_state":
            _reshard_extra(src, dst, world_size_from, world_size_to, step)
        else:
            _reshard_sharded_kind(src, dst, kind, world_size_from, world_size_to)
    _copy_others(src, dst, world_size_to)
    fsync(dst)
    return world_size_from


def _check_fsdp_version(src: str) -> None:
    path = os.path.join(src, FSDP_CONFIG)
    if not os.path.exists(path):
        return
    with open(path) as f:
        version = json.load(f).get("FSDP_version")
    if version != 2:
        raise ReshardRefused(f"{path}: FSDP_version={version!r}; resharding reads FSDP2 checkpoints (strategy=fsdp2)")
