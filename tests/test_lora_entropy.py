"""With LoRA, the entropy verl hands the estimators is the adapted model's (base + adapter), not the base model's.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_lora_entropy.py

Why: under ``actor_rollout_ref.model.lora_rank > 0`` verl's FSDP engine wraps the base model in a PEFT
``PeftModelForCausalLM`` and trains only the adapter; the same module serves the reference log-probs with the adapter
switched off (``no_lora_adapter`` -> ``FSDPEngine.disable_adapter()``). GTPO, GRPO-S and GTPO-traj shape their
advantages with the old-log-prob pass's entropy; if that pass ran on the base weights, the estimators would read
the entropy of a policy that is not being trained, and nothing would fail.

What: the demo's tiny Qwen2 wrapped by verl's own ``FSDPEngine._build_lora_module`` (rank 8, alpha 16,
``all-linear``: what the trainer's ``actor_rollout_ref.model.*`` keys build), every ``lora_B`` set to seeded noise
(PEFT initialises B to zero, which would make adapted and base identical). The entropy is computed by verl's
``FSDPEngineWithLMHead.forward_step`` (the old-log-prob pass's forward: remove padding, ``calculate_entropy``,
chunked entropy in 16-token chunks as on the CPU backend) on three sequences packed into one row. The expected
values are computed without verl: each sequence alone through a merged copy (``merge_and_unload``: W + (alpha/r) B A
folded into the weights, a plain ``Qwen2ForCausalLM``) and through the base model, ``H = -sum p log p`` by hand.

Checked: verl's entropy equals the merged model's within 1e-5 on every token, differs from the base model's by more
than 1e-2 somewhere (the adapter moves it), and under ``disable_adapter()`` (the reference pass's context) equals
the base model's: the comparison can tell the two apart. No Ray, no process group: a few seconds.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

LORA_RANK = 8
LORA_ALPHA = 16
CHUNK = 16
LENGTHS = (11, 7, 14)
VOCAB = 32


@pytest.fixture(scope="module")
def models():
    """``(peft_model, merged, base)``: verl's LoRA wrapping of the tiny model with non-zero B, a merged copy, and
    the unwrapped base model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from gtpo.cpu.demo_task import MODEL_RECIPE

    config = Qwen2Config(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=0, **MODEL_RECIPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config).to(torch.float32).eval()
    # _build_lora_module reads only the model config's LoRA keys from the engine
    model_config = SimpleNamespace(
        lora_rank=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules="all-linear",
        target_parameters=None,
        exclude_modules=None,
        lora_adapter_path=None,
    )
    peft_model = FSDPEngine._build_lora_module(SimpleNamespace(model_config=model_config), copy.deepcopy(base))
    gen = torch.Generator().manual_seed(1)
    lora_b = [p for name, p in peft_model.named_parameters() if "lora_B" in name]
    assert lora_b and all(float(p.detach().abs().max()) == 0.0 for p in lora_b), "PEFT should start B at zero"
    with torch.no_grad():
        for p in lora_b:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    peft_model.eval()
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    assert type(merged) is Qwen2ForCausalLM
    return peft_model, merged, base


@pytest.fixture(scope="module")
def sequences() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(2, VOCAB, (n,), generator=gen) for n in LENGTHS]


def reference_entropy(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of one sequence through ``model`` alone (no packing, no verl): ``-sum p log p``."""
    with torch.no_grad():
        logits = model(input_ids=ids.unsqueeze(0)).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1).float()


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    """verl's engine module on this process's CPU (the CPU backend's platform does this in a worker)."""
    from verl.workers.engine.fsdp import transformer_impl

    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")


def verl_entropy(module, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """verl's old-log-prob forward on ``module``: ``FSDPEngineWithLMHead.forward_step`` with ``calculate_entropy``
    on the packed sequences, the engine's state being what the CPU backend configures (fp32, no Ulysses, chunked
    entropy)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.torch_functional import entropy_from_logits_with_chunking
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.module = module
    engine.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=True, entropy_from_logits_chunk_size=CHUNK
    )
    engine.compute_entropy_from_logits = entropy_from_logits_with_chunking
    engine.use_ulysses_sp = False
    engine.pad_to_length = None
    engine._autocast_dtype = torch.float32
    batch = TensorDict(
        {
            "input_ids": torch.nested.as_nested_tensor(sequences, layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor(
                [torch.arange(len(s)) for s in sequences], layout=torch.jagged
            ),
            "temperature": torch.ones(len(sequences)),
        },
        batch_size=[len(sequences)],
    )
    tu.assign_non_tensor(batch, use_remove_padding=True, calculate_entropy=True, use_fused_kernels=False)
    with torch.no_grad():
        _, output = engine.forward_step(batch, loss_function=None, forward_only=True)
    return list(output["model_output"]["entropy"].unbind())


def test_the_old_log_prob_entropy_is_the_adapted_models(models, sequences):
    peft_model, merged, base = models
    got = verl_entropy(peft_model, sequences)
    assert [len(h) for h in got] == list(LENGTHS)
    adapted_gap = base_gap = 0.0
    for ids, h in zip(sequences, got, strict=True):
        adapted_gap = max(adapted_gap, float((h - reference_entropy(merged, ids)).abs().max()))
        base_gap = max(base_gap, float((h - reference_entropy(base, ids)).abs().max()))
    assert adapted_gap < 1e-5, f"verl's entropy is not the adapted model's: max |dH| {adapted_gap:.2e}"
    assert base_gap > 1e-2, f"the adapter does not move the entropy (max |dH| vs base {base_gap:.2e})"


def test_the_reference_context_gives_the_base_models_entropy(models, sequences):
    """The control: with the adapter disabled (verl's reference pass) the same forward gives the base entropy, so
    the comparison above separates the two models."""
    peft_model, _, base = models
    with peft_model.disable_adapter():
        got = verl_entropy(peft_model, sequences)
    for ids, h in zip(sequences, got, strict=True):
        torch.testing.assert_close(h, reference_entropy(base, ids), atol=1e-5, rtol=0)
