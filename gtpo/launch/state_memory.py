"""The model-sized terms of a run's memory per GPU, from a resolved config (printed by the dry run beside the
vocabulary-sized terms of :mod:`gtpo.launch.memory_estimate`).

* **Actor states.** Full training (verl 0.9.1's FSDP2 engine, ``model_dtype`` fp32): parameters, gradients and
  AdamW's two moments, 16 B per parameter, sharded over the ``W`` ranks. LoRA (``model.lora_rank > 0``): the frozen
  base's parameters only (4 B each in fp32, 2 B in bf16/fp16), sharded likewise, plus the adapters' 16 B per adapter
  parameter; ``fsdp_config.param_offload`` keeps the parameters in host memory between passes.
* **vLLM.** Each replica holds the bf16 weights over its ``tensor_model_parallel_size`` GPUs; its KV cache is what
  ``gpu_memory_utilization`` of the GPU leaves, ``2 x layers x KV heads x head size x 2 B`` per token, on each GPU
  the run is sized for (:mod:`gtpo.launch.gpu_peak`).

The architecture comes from the model folder's ``config.json`` when it is readable here, else from
:data:`KNOWN_MODELS` by the folder's name (the presets' models). Estimates from the code, not GPU measurements.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

__all__ = ["KNOWN_MODELS", "Architecture", "architecture", "lora_parameters", "model_mismatch", "state_lines"]

GB = 1e9


@dataclass(frozen=True)
class Architecture:
    """The sizes of a decoder-only transformer that set its memory."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = True  # Qwen2's q/k/v projections have biases; Qwen3's do not
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of queries and keys

    @property
    def parameters(self) -> int:
        """Embedding (+ LM head unless tied), attention (q/k/v, their biases or q/k norms, o), MLP (gate/up/down),
        norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        attention += (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_norm else 0)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


# config.json values of the presets' models (Hugging Face), by the model folder's name.
KNOWN_MODELS = {
    "Qwen2.5-3B": Architecture(36, 2048, 16, 2, 128, 11008, 151936, True),
    "Qwen2.5-7B": Architecture(28, 3584, 28, 4, 128, 18944, 152064, False),
    "Qwen2.5-7B-Instruct": Architecture(28, 3584, 28, 4, 128, 18944, 152064, False),  # the tool-use launcher's
    "Qwen2.5-32B": Architecture(64, 5120, 40, 8, 128, 27648, 152064, False),
    "Qwen2.5-0.5B-Instruct": Architecture(24, 896, 14, 2, 64, 4864, 151936, True),
    "Qwen3-8B-Base": Architecture(36, 4096, 32, 8, 128, 12288, 151936, False, qkv_bias=False, qk_norm=True),
    "Qwen3-32B": Architecture(64, 5120, 64, 8, 128, 25600, 151936, False, qkv_bias=False, qk_norm=True),
}


def architecture(model_path: str) -> tuple[Architecture | None, str]:
    """The model's architecture and where it came from; ``(None, why)`` when neither source knows it."""
    path = Path(os.path.expanduser(model_path)) / "config.json"
    try:
        c = json.loads(path.read_text())
        heads = int(c["num_attention_heads"])
        arch = Architecture(
            int(c["num_hidden_layers"]), int(c["hidden_size"]), heads, int(c.get("num_key_value_heads", heads)),
            int(c.get("head_dim") or c["hidden_size"] // heads), int(c["intermediate_size"]), int(c["vocab_size"]),
            bool(c.get("tie_word_embeddings", False)), qkv_bias=str(c.get("model_type")) != "qwen3",
            qk_norm=str(c.get("model_type")) == "qwen3",
        )  # fmt: skip
        return arch, f"{path}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    name = os.path.basename(os.path.normpath(str(model_path)))
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name], f"{name}'s config.json, by the folder's name"
    return None, f"no readable {path} and {name!r} is not one of {sorted(KNOWN_MODELS)}"


def model_mismatch(expected: str, model_path: str) -> str | None:
    """How the model folder ``model_path`` differs from the model ``expected`` (a :data:`KNOWN_MODELS` name, the one a
    preset is sized for), by its ``config.json``; None when they match or either is unknown here."""
    known = KNOWN_MODELS.get(expected)
    path = Path(os.path.expanduser(model_path)) / "config.json"
    if known is None or not path.is_file():
        return None
    found, _ = architecture(model_path)
    if found is None or found == known:
        return None
    fields = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")
    differ = [f"{f} {getattr(found, f)} (not {getattr(known, f)})" for f in fields
              if getattr(found, f) != getattr(known, f)]  # fmt: skip
    named = next((name for name, arch in KNOWN_MODELS.items() if arch == found), None)
    return f"{path} describes {named or 'another model'}: " + ", ".join(differ or ["other sizes"])


def lora_parameters(arch: Architecture, rank: int, target_modules: object) -> int:
    """Adapter parameters: ``rank x (in + out)`` per adapted linear layer (``all-linear``: q, k, v, o, gate, up,
    down of every layer; a list: those of its names among them)."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    shapes = {
        "q_proj": (arch.hidden, q), "k_proj": (arch.hidden, kv), "v_proj": (arch.hidden, kv),
        "o_proj": (q, arch.hidden), "gate_proj": (arch.hidden, arch.intermediate),
        "up_proj": (arch.hidden, arch.intermediate), "down_proj": (arch.intermediate, arch.hidden),
    }  # fmt: skip
    names = shapes if str(target_modules) == "all-linear" else [n for n in shapes if n in list(target_modules)]
    return arch.layers * sum(rank * sum(shapes[n]) for n in names)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def state_lines(cfg: DictConfig) -> list[str]:
    """The dry run's model-sized memory lines for a resolved config."""
    model = cfg.actor_rollout_ref.model
    arch, source = architecture(str(model.path))
    if arch is None:
        return [f"model-sized terms: not estimated ({source})"]
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    fsdp = cfg.actor_rollout_ref.actor.get("fsdp_config", {})
    where = "host memory between passes (param_offload)" if fsdp.get("param_offload", False) else "GPU"
    n = arch.parameters
    rank = int(model.get("lora_rank", 0) or 0)
    if rank > 0:
        adapters = lora_parameters(arch, rank, model.get("target_modules", "all-linear"))
        base_bytes = 2 if str(fsdp.get("model_dtype", "fp32")) in ("bf16", "fp16", "bfloat16", "float16") else 4
        actor = (
            f"actor (LoRA r={rank}): frozen base {_count(n)} x {base_bytes} B / {world} rank(s) = "
            f"{n * base_bytes / world / GB:.1f} GB on the {where}; adapters {_count(adapters)} x 16 B "
            f"(parameters, gradients, AdamW) = {adapters * 16 / world / GB:.2f} GB"
        )
    else:
        actor = (
            f"actor: {_count(n)} parameters x 16 B (fp32 parameters, gradients, AdamW) / {world} rank(s) = "
            f"{n * 16 / world / GB:.1f} GB (parameters on the {where})"
        )
    rollout = cfg.actor_rollout_ref.rollout
    tp = int(rollout.get("tensor_model_parallel_size", 1) or 1)
    weights = n * 2 / tp / GB
    util = float(rollout.get("gpu_memory_utilization", 0.5))
    return [
        f"memory estimate per GPU, model-sized terms ({source}); not measured:",
        f"  {actor}",
        f"  vLLM (tp={tp}): bf16 weights {weights:.1f} GB in its share gpu_memory_utilization={util} of the GPU (its "
        "KV cache on the GPUs the run is sized for: below)",
    ]
