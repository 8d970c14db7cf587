"""The dry run's model-sized memory terms (gtpo.launch.state_memory): parameter and adapter counts against real
models, and the lines the LoRA presets print.

    .venv/bin/python -m pytest -q tests/test_state_memory.py
"""

from __future__ import annotations

import json

import pytest

from gtpo.launch.state_memory import KNOWN_MODELS, Architecture, architecture, lora_parameters, state_lines
from tests.support.configs import compose


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_is_a_real_qwen2s(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = Architecture(3, 64, 4, 2, 16, 96, 101, tied)
    config = Qwen2Config(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=101, tie_word_embeddings=tied,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    assert arch.parameters == sum(p.numel() for p in model.parameters())


def test_the_parameter_count_is_a_real_qwen3s():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    arch = Architecture(3, 64, 4, 2, 32, 96, 101, False, qkv_bias=False, qk_norm=True)
    config = Qwen3Config(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=96, vocab_size=101, tie_word_embeddings=False,
    )  # fmt: skip
    assert arch.parameters == sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_the_adapter_count_is_peft_s(targets):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = Architecture(2, 64, 4, 2, 16, 96, 101, False)
    config = Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=101,
    )  # fmt: skip
    model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(arch, 8, targets) == trainable


def test_the_presets_models_match_their_published_sizes():
    """The model cards: Qwen2.5 3.09 B, 7.61 B (base and instruct), 32.8 B, 0.49 B; Qwen3 8.2 B, 32.8 B parameters."""
    sizes = {k: round(v.parameters / 1e9, 2) for k, v in KNOWN_MODELS.items()}
    assert sizes == {
        "Qwen2.5-3B": 3.09, "Qwen2.5-7B": 7.62, "Qwen2.5-7B-Instruct": 7.62, "Qwen2.5-32B": 32.76,
        "Qwen2.5-0.5B-Instruct": 0.49, "Qwen3-8B-Base": 8.19, "Qwen3-32B": 32.76,
    }  # fmt: skip


def test_a_readable_config_json_wins_over_the_name(tmp_path):
    folder = tmp_path / "Qwen2.5-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 101, "tie_word_embeddings": True,
    }))  # fmt: skip
    arch, source = architecture(str(folder))
    assert arch == Architecture(2, 64, 4, 2, 16, 96, 101, True) and source == str(folder / "config.json")
    assert architecture(str(tmp_path / "Qwen2.5-32B"))[0] == KNOWN_MODELS["Qwen2.5-32B"]
    missing, why = architecture(str(tmp_path / "Mystery-1B"))
    assert missing is None and "'Mystery-1B' is not one of" in why


def test_a_config_head_dim_wins_over_hidden_over_heads(tmp_path):
    """Qwen3-32B's heads are 128 wide although 5120 / 64 = 80: a readable config.json's ``head_dim`` counts."""
    folder = tmp_path / "my-qwen3-32b"
    folder.mkdir()
    known = KNOWN_MODELS["Qwen3-32B"]
    config = {
        "model_type": "qwen3", "num_hidden_layers": known.layers, "hidden_size": known.hidden,
        "num_attention_heads": known.heads, "num_key_value_heads": known.kv_heads, "head_dim": known.head_dim,
        "intermediate_size": known.intermediate, "vocab_size": known.vocab, "tie_word_embeddings": known.tied,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    arch, source = architecture(str(folder))
    assert arch == known and source.endswith("config.json")


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", "fp16", "float16"])
def test_a_frozen_base_in_16_bits_is_2_bytes_a_parameter_however_spelt(dtype):
    cfg = compose(["method=gtpo", "model=qwen2.5_7b", "adapter=lora",
                   f"actor_rollout_ref.actor.fsdp_config.model_dtype={dtype}"])  # fmt: skip
    text = "\n".join(state_lines(cfg))
    assert "frozen base 7.62 B x 2 B / 1 rank(s) = 15.2 GB" in text, text


def test_the_one_gpu_lora_presets_state_their_memory():
    """adapter=lora on Qwen2.5-7B: the frozen fp32 base on the host between passes (7.62 B x 4 B = 30.5 GB), the
    rank-128 adapters' states, vLLM's bf16 copy (15.2 GB) in its share of the GPU."""
    cfg = compose(["method=gtpo", "model=qwen2.5_7b", "adapter=lora", "actor_rollout_ref.model.path=/m/Qwen2.5-7B"])
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 1)
    assert cfg.actor_rollout_ref.actor.optim.lr == 1.0e-5  # the adapter's rate wins over the scale's 1e-6
    lines = state_lines(cfg)
    adapters = lora_parameters(KNOWN_MODELS["Qwen2.5-7B"], 128, "all-linear")
    assert lines[1] == (
        f"  actor (LoRA r=128): frozen base 7.62 B x 4 B / 1 rank(s) = 30.5 GB on the host memory between passes "
        f"(param_offload); adapters {adapters / 1e6:.1f} M x 16 B (parameters, gradients, AdamW) = "
        f"{adapters * 16 / 1e9:.2f} GB"
    )
    assert lines[2] == (
        "  vLLM (tp=1): bf16 weights 15.2 GB in its share gpu_memory_utilization=0.8 of the GPU (its KV cache on the "
        "GPUs the run is sized for: below)"
    )
    full = state_lines(compose(["method=gtpo", "model=qwen2.5_7b", "actor_rollout_ref.model.path=/m/Qwen2.5-7B"]))
    assert (
        full[1] == "  actor: 7.62 B parameters x 16 B (fp32 parameters, gradients, AdamW) / 8 rank(s) = 15.2 GB "
        "(parameters on the GPU)"
    )
