"""The entropy verl's FSDP engine computes from the logits: how often it compiles, and what it keeps for a backward.

    .venv/bin/python -m pytest -q tests/test_entropy_compile.py

verl 0.9.1's ``FSDPEngine.__init__`` wraps ``entropy_from_logits_with_chunking`` in ``torch.compile(dynamic=True)``
when ``fsdp_config.use_torch_compile`` (its default). The function loops over chunks in Python, so dynamo
specialises on the token count and recompiles for every new one until ``recompile_limit`` (8), which the
old-log-prob pass of step 1 reaches (every micro-batch of a dynamic batch has its own token count); after that it
runs eagerly. The engine here is verl's own, built on CPU in a one-process gloo group; the default case counts
dynamo frames with a counting backend (the recompiles are dynamo's guards, whatever backend compiles the graphs;
inductor takes ~6 s per recompile on a 2-core CPU, 26 s for the first), the recipe's presets compile nothing.

The memory side, measured with saved-tensor hooks: an entropy computed with autograd keeps the fp32 copy and the
softmax of every chunk (8 bytes per token and vocabulary entry: the "x 4 B x 2" of
``gtpo.launch.memory_estimate``); inside verl's ``entropy_checkpointing`` checkpoint it keeps only its input.
"""

from __future__ import annotations

import socket
import types

import pytest
import torch

from tests.support.configs import compose

TOKEN_COUNTS = (37, 50, 64, 81, 100, 130, 200, 257, 300, 333, 400)  # a step's worth of micro-batch sizes
VOCAB = 32


@pytest.fixture(scope="module")
def process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine(engine_config):
    """verl's FSDPEngine with only what its constructor reads (no model is built)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    model_config = types.SimpleNamespace(use_remove_padding=True, lora_rank=0, get=lambda key, default=None: default)
    return FSDPEngine(model_config, engine_config, None, None)


def _frames_over_a_step(fn) -> int:
    from torch._dynamo.utils import counters

    before = counters["frames"]["ok"]
    for n in TOKEN_COUNTS:
        fn(torch.randn(n, VOCAB), chunk_size=16)
    return counters["frames"]["ok"] - before


def test_verl_default_recompiles_for_every_new_token_count(process_group, monkeypatch):
    """The reason for the presets' setting: verl's default compiles until the recompile limit, then gives up."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from verl.workers.config import FSDPEngineConfig

    counter = CompileCounter()
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend=counter, **kw))
    torch._dynamo.reset()
    engine = _engine(FSDPEngineConfig(strategy="fsdp2", entropy_from_logits_with_chunking=True))
    assert FSDPEngineConfig().use_torch_compile is True  # verl's default
    for n in TOKEN_COUNTS:
        engine.compute_entropy_from_logits(torch.randn(n, VOCAB), chunk_size=16)
    limit = torch._dynamo.config.recompile_limit
    assert len(TOKEN_COUNTS) > limit == 8
    assert counter.frame_count == limit, "one compile per token count until the limit, eager after it"
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=qwen2.5_7b"],
        ["model=qwen2.5_32b"],
        ["model=qwen2.5_7b", "method=dapo_forking"],
        ["model=qwen2.5_0.5b", "scale=smoke"],
    ],
)
def test_presets_run_the_chunked_entropy_without_compiling(process_group, overrides):
    """The engine built from each model preset's resolved actor config compiles nothing over a step's token counts
    and computes verl's fp32 chunked entropy."""
    import torch._dynamo
    from omegaconf import OmegaConf
    from verl.utils import torch_functional as verl_F
    from verl.utils.config import omega_conf_to_dataclass

    import gtpo.verl_plugin.register  # noqa: F401

    cfg = compose(["method=gtpo", *overrides])
    OmegaConf.resolve(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    torch._dynamo.reset()
    engine = _engine(actor.engine)
    assert _frames_over_a_step(engine.compute_entropy_from_logits) == 0
    logits = torch.randn(70, VOCAB, dtype=torch.bfloat16)
    out = engine.compute_entropy_from_logits(logits, chunk_size=16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, verl_F.entropy_from_logits(logits.float()))


def _saved_bytes(fn, logits) -> tuple[int, bool]:
    """Bytes of the distinct storages autograd saves for the backward while ``fn(logits)`` runs, besides ``logits``
    itself, and whether ``logits`` is among them."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits)
    own = storages.pop(logits.untyped_storage().data_ptr(), None)
    return sum(storages.values()), own is not None


def test_entropy_with_autograd_keeps_two_fp32_copies_per_vocabulary_entry():
    from verl.utils import torch_functional as verl_F

    from gtpo.launch.memory_estimate import CHUNK_BYTES, LOGITS_BYTES

    tokens, vocab = 64, 1000
    logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, requires_grad=True)

    def chunked(x):
        return verl_F.entropy_from_logits_with_chunking(x, chunk_size=16)

    kept, _ = _saved_bytes(chunked, logits)
    assert kept / (tokens * vocab) == pytest.approx(CHUNK_BYTES * 2, rel=0.01)
    # verl's entropy_checkpointing (a reentrant checkpoint): only the bf16 input itself, no copy
    kept, input_saved = _saved_bytes(
        lambda x: torch.utils.checkpoint.checkpoint(chunked, x, use_reentrant=True), logits
    )
    assert kept == 0 and input_saved and logits.element_size() == LOGITS_BYTES
