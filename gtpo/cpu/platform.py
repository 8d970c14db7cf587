"""verl platform ``cpu``: lets verl 0.9.1's FSDP2 workers run on a machine without accelerator (tests/demos only).

Registered with ``verl.plugin.platform.PlatformRegistry`` under the name ``cpu`` and selected by ``VERL_PLATFORM=cpu``
(verl's own registry has no CPU entry and falls back to ``nvidia``, i.e. ``cuda`` / ``nccl``). It reports device
``cpu``, collective backend ``gloo`` and Ray resource ``GPU``: the trainer's placement groups still ask for one
accelerator per worker, which ``ray_init.num_gpus=1`` satisfies with a logical, fake GPU.

``current_device()`` returns the string ``"cpu"`` (not an index): verl moves tensors with ``.to(get_device_id())``
and an int 0 would mean ``cuda:0``. ``device_module`` is a stand-in wrapping ``torch.cpu`` that adds the CUDA
memory / RNG / naming calls verl makes unconditionally (memory stats read 0, ``mem_get_info`` reports 8 of 16 GiB
free, ``get_device_name`` is ``"CPU"`` so the FLOPs counter finds no peak and reports 0 MFU).

Importing this module with ``VERL_PLATFORM=cpu`` also changes one verl default:
``verl.utils.distributed.initialize_global_process_group_ray`` builds ``"cpu:gloo,<device>:<backend>"``, which is
``"cpu:gloo,cpu:gloo"`` here and rejected by torch as a duplicate device type; the wrapper makes a missing
``backend`` default to plain ``"gloo"``. The wrapper is installed before ``verl.workers.engine_workers`` binds the
name, because the module is listed in ``VERL_USE_EXTERNAL_MODULES`` and imported from ``verl/__init__``. Without
``VERL_PLATFORM=cpu`` the import only registers the platform: on a GPU worker the wrapper would make FSDP's process
group gloo-only, silently and very slowly. With ``VERL_PLATFORM=cpu`` it also registers the backend's attention
implementation ``gtpo_cpu_sdpa`` (:mod:`gtpo.cpu.ulysses_attention`) with transformers.
"""

from __future__ import annotations

import functools
import os
import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

_GIB = 1 << 30


def _noop(*args, **kwargs) -> None:
    return None


def _zero(*args, **kwargs) -> int:
    return 0


def _build_device_module() -> types.ModuleType:
    """A ``torch.cpu`` look-alike exposing the ``torch.cuda`` calls verl makes on its device module."""
    mod = types.ModuleType("gtpo_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    for name in (
        "memory_reserved",
        "memory_allocated",
        "max_memory_reserved",
        "max_memory_allocated",
        "memory_cached",
        "max_memory_cached",
    ):
        setattr(mod, name, _zero)
    for name in (
        "empty_cache",
        "reset_peak_memory_stats",
        "reset_max_memory_allocated",
        "reset_max_memory_cached",
        "reset_accumulated_memory_stats",
        "set_device",
        "ipc_collect",
        "manual_seed",
        "manual_seed_all",
        "set_per_process_memory_fraction",
    ):
        setattr(mod, name, _noop)
    mod.synchronize = _noop
    mod.current_device = lambda: "cpu"
    mod.device_count = lambda: 1
    mod.is_available = lambda: True
    mod.is_initialized = lambda: True
    mod.get_device_name = lambda *a, **k: "CPU"
    mod.get_device_capability = lambda *a, **k: (None, None)
    mod.mem_get_info = lambda *a, **k: (8 * _GIB, 16 * _GIB)
    mod.memory_stats = lambda *a, **k: {}
    mod.memory_summary = lambda *a, **k: ""
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.get_rng_state_all = lambda: [torch.get_rng_state()]
    mod.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    mod.Stream = torch.cpu.Stream
    mod.Event = torch.cpu.Event
    mod.stream = torch.cpu.stream
    mod.current_stream = torch.cpu.current_stream
    mod.nvtx = types.SimpleNamespace(range=_null_context, range_push=_noop, range_pop=_noop, mark=_noop)
    mod.profiler = types.SimpleNamespace(start=_noop, stop=_noop)
    mod.memory = types.SimpleNamespace(
        _set_allocator_settings=_noop, _record_memory_history=_noop, _dump_snapshot=_noop
    )
    return mod


@contextmanager
def _null_context(*args, **kwargs):
    yield


CPU_DEVICE_MODULE = _build_device_module()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """Plain CPU "accelerator" for verl (gloo collectives, one fake Ray ``GPU`` per worker)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only VERL_PLATFORM=cpu selects it, so GPU hosts keep verl's own detection.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets it for actors holding a (fake) GPU; nothing reads it on CPU.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _install_gloo_default() -> None:
    """Make ``initialize_global_process_group_ray(backend=None)`` use plain ``gloo`` (idempotent)."""
    import verl.utils.distributed as dist_utils

    original = dist_utils.initialize_global_process_group_ray
    if getattr(original, "_gtpo_gloo_default", False):
        return

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray._gtpo_gloo_default = True
    dist_utils.initialize_global_process_group_ray = initialize_global_process_group_ray
    # Modules that bound the name before this import (none in verl 0.9.1 when loaded through
    # VERL_USE_EXTERNAL_MODULES) get the wrapper too.
    import sys

    for mod_name in ("verl.workers.engine_workers", "verl.checkpoint_engine.base"):
        mod = sys.modules.get(mod_name)
        if mod is not None and getattr(mod, "initialize_global_process_group_ray", None) is original:
            mod.initialize_global_process_group_ray = initialize_global_process_group_ray


# verl reads VERL_PLATFORM the same way (verl/plugin/platform/platform_manager.py).
if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    _install_gloo_default()
    # the CPU backend's attention (configs/backend/cpu_tiny.yaml): SDPA that honours Ulysses sequence parallelism
    from gtpo.cpu.ulysses_attention import register as _register_attention

    _register_attention()
