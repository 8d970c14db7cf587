"""verl rollout ``hf``: a transformers-based token-in/token-out server for CPU tests and demos (never for training).

verl 0.9.1 only wires ``vllm``, ``sglang`` and ``trtllm`` as rollout backends (``_ROLLOUT_REGISTRY`` in
``verl.workers.rollout.base`` and ``RolloutReplicaRegistry`` in ``verl.workers.rollout.replica``); none runs without
a GPU. Importing this module registers ``actor_rollout_ref.rollout.name=hf``:

* :class:`HFRolloutServer`, a Ray actor (``num_cpus=0``, named ``hf_server_<replica>_0``), holds a causal LM in
  float32 with SDPA attention and implements the server calls verl's agent loop, ``CheckpointEngineManager`` and
  v1 trainers make: ``generate`` (token ids in, :class:`TokenOutput` out), ``update_weights``,
  ``set_global_steps`` and the memory / scheduling controls (``wake_up``, ``sleep``, ``clear_kv_cache``,
  ``release_kv_cache``, ``resume_kv_cache``, ``abort_all_requests``, ``abort_request``, ``resume_generation``,
  ``resume_engine_generation``, ``open_submission_gate``, ``wait_for_requests_to_drain``, ``start_profile``,
  ``stop_profile``); the abort / resume calls implement verl's partial rollout (async trainers), the others are
  no-ops on CPU because nothing is offloaded.
* :class:`HFReplica` (``RolloutReplica``) starts one server per replica (hybrid mode only: TP = PP = DP = 1).
* :class:`HFServerAdapter` (``BaseRollout``) lives in the hybrid actor worker; ``update_weights`` gathers the
  FSDP engine's ``(name, tensor)`` stream (HF state-dict keys, full tensors) into one CPU float32 dict and sends
  it to the replica's server, which loads it with ``load_state_dict(strict=False)``; ``lm_head.weight`` is tied to
  the embedding in Qwen2 small models and loads into the same storage.

Modules: :mod:`gtpo.cpu.hf_sampler` (the sampling core and its vLLM-compatible semantics), :mod:`gtpo.cpu.hf_server`
(the server actor body); this module holds the verl glue and the registration.
"""

from __future__ import annotations

import os

import ray
import torch
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from gtpo.cpu.hf_sampler import GenRequest, GenResult, HFSampler
from gtpo.cpu.hf_server import HFRolloutServer, load_causal_lm

__all__ = [
    "GenRequest",
    "GenResult",
    "HFReplica",
    "HFRolloutServer",
    "HFSampler",
    "HFServerAdapter",
    "load_causal_lm",
    "register",
]

ROLLOUT_NAME = "hf"
SERVER_NAME_PREFIX = "hf_server_"


# ---------------------------------------------------------------------------------------------------------------
# verl glue: replica (trainer side) and adapter (actor-worker side)


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_NAME_PREFIX}{replica_rank}_{node_rank}"


class HFReplica(RolloutReplica):
    """One :class:`HFRolloutServer` per replica; hybrid mode only."""

    async def launch_servers(self):
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(f"the hf rollout supports hybrid mode only, got {self.rollout_mode}")
        if self.world_size != 1:
            raise ValueError(
                "the hf rollout needs tensor/data/pipeline parallel size 1 per replica, "
                f"got world size {self.world_size}"
            )
        name = server_actor_name(self.replica_rank)
        server = (
            ray.remote(HFRolloutServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
                node_rank=0,
            )
        )
        host, _ = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{host}:{name}"


class HFServerAdapter(BaseRollout):
    """Hybrid-worker side of the hf rollout: forwards the actor's weights to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        """Gather ``(name, tensor)`` into a CPU float32 dict and send it to this replica's server."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout accepts wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError(
                "the hf rollout cannot apply LoRA adapters; set actor_rollout_ref.model.lora.merge=True"
            )
        state: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            state[name] = tensor.detach().to("cpu", torch.float32).clone()
        if self.rollout_rank != 0:
            return None
        await self._server_handle().update_weights.remote(state, global_steps=kwargs.get("global_steps"))
        return None

    def generate_sequences(self, prompts):
        raise NotImplementedError("the hf rollout serves generation through its server actor only")


def _load_hf_replica() -> type[RolloutReplica]:
    return HFReplica


def register() -> None:
    """Register ``hf`` in verl's two rollout registries (idempotent)."""
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_hf_replica)


register()
