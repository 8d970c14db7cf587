"""Each pass's peak memory per GPU on the GPUs a run is sized for (``algorithm.hardware.gpu_memory_gib``): what the
dry run prints, and what the launch checks refuse (:func:`peak_problems`) before Ray starts.

A colocated run's GPU serves four passes in turn, each with what verl 0.9.1 keeps on it then:

* **generation**: vLLM's share (``gpu_memory_utilization`` x the card: its weights, KV cache and runtime) beside what
  the actor keeps on the GPU between passes (the parameters without ``param_offload``, AdamW without
  ``optimizer_offload``; the gradients are freed) and the actor's CUDA context;
* **weight sync** (the naive engine, ``update_weights``): vLLM's weights resumed, the actor's model staged to the GPU
  (all of it for a LoRA model, whose sync always stages it; an FSDP2 full model gathers one tensor at a time), then
  offloaded before the KV cache comes back;
* **old-log-prob** (and the reference pass): the model staged for the pass (``BaseEngineCtx`` in eval mode moves the
  parameters, not the optimizer), its bf16 working copy (two layers all-gathered and the LM head), one layer's
  activations, the vocabulary-sized terms of :mod:`gtpo.launch.memory_estimate`, vLLM asleep;
* **training**: parameters, gradients and AdamW staged (train mode moves all three), the checkpointed layer inputs,
  one layer's recompute, the bf16 working copy, the vocabulary-sized terms, vLLM asleep.

Under ``separate_async`` (``hybrid_engine=false``) the trainer's GPUs hold no vLLM, and the rollout pool's hold vLLM's
share only. The allowances are stated, not measured: :data:`ACTOR_CONTEXT_GIB` (the actor process's CUDA context,
NCCL and cuBLAS workspaces), :data:`VLLM_ASLEEP_GIB` (what vLLM keeps while asleep: its context and CUDA graphs),
:data:`VLLM_RUNTIME_GIB` (vLLM's non-KV memory inside its share: CUDA graphs, the profiled activations, the sampler),
:data:`CARD_RESERVE_GIB` (what a card reports but cannot give). Estimates from the code, not GPU measurements: the
first run's ``nvidia-smi`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

__all__ = ["ACTOR_CONTEXT_GIB", "CARD_RESERVE_GIB", "VLLM_ASLEEP_GIB", "VLLM_RUNTIME_GIB", "Pass", "cards",
           "kv_cache", "largest_share", "passes", "peak_lines", "peak_problems"]  # fmt: skip

GIB = 2**30
ACTOR_CONTEXT_GIB = 1.0
VLLM_ASLEEP_GIB = 1.0
VLLM_RUNTIME_GIB = 1.5
CARD_RESERVE_GIB = 0.5


@dataclass(frozen=True)
class Pass:
    """One pass's terms per GPU (``(what, GiB)``), plus vLLM's share of the card where it generates."""

    name: str
    parts: tuple[tuple[str, float], ...]
    vllm_share: float = 0.0

    def total(self, card: float) -> float:
        return sum(gib for _, gib in self.parts) + self.vllm_share * card

    def describe(self, card: float) -> str:
        terms = [f"vLLM {self.vllm_share:g} x {card:g} = {self.vllm_share * card:.1f}"] if self.vllm_share else []
        terms += [f"{what} {gib:.1f}" for what, gib in self.parts if gib >= 0.05]
        return f"{self.name}: {' + '.join(terms)} = {self.total(card):.1f} GiB"


def cards(cfg: DictConfig) -> tuple[float, ...]:
    from gtpo.methods import knob

    return knob(cfg.algorithm, "hardware").gpu_memory_gib


def _get(cfg: DictConfig, key: str, default=None):
    return OmegaConf.select(cfg, key, default=default)


def _layer_parameters(arch) -> float:
    embeddings = arch.vocab * arch.hidden * (1 if arch.tied else 2)
    return (arch.parameters - embeddings - arch.hidden) / arch.layers


def _activations(arch, tokens: int) -> float:
    """One decoder layer's activations for ``tokens`` tokens in bf16: attention projections and the MLP's gate, up
    and their product, the layer's input and output."""
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    return tokens * (2 * q + 2 * kv + 3 * arch.intermediate + 2 * arch.hidden) * 2 / GIB


def passes(cfg: DictConfig, arch, vocab: int) -> list[Pass]:
    """The passes of a GPU of this run (see the module docstring), for the model ``arch``."""
    from gtpo.launch.memory_estimate import _budget, pass_terms
    from gtpo.launch.state_memory import lora_parameters

    model, actor, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    fsdp = actor.get("fsdp_config", None) or {}
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    param_offload = bool(fsdp.get("param_offload", False))
    optimizer_offload = bool(fsdp.get("optimizer_offload", False))
    base_bytes = 2 if str(fsdp.get("model_dtype", "fp32")) in ("bf16", "fp16", "bfloat16", "float16") else 4
    rank = int(model.get("lora_rank", 0) or 0)
    n = arch.parameters
    adapters = lora_parameters(arch, rank, model.get("target_modules", "all-linear")) if rank > 0 else 0
    trained = adapters if rank > 0 else n
    params = (n * base_bytes + adapters * 4) / world / GIB
    grads, adam = trained * 4 / world / GIB, trained * 8 / world / GIB
    what = "base + adapters" if rank > 0 else "parameters"
    working = (2 * _layer_parameters(arch) + arch.vocab * arch.hidden) * 2 / GIB
    hybrid = bool(cfg.actor_rollout_ref.get("hybrid_engine", True))
    share = float(rollout.get("gpu_memory_utilization", 0.5))
    tp = int(rollout.get("tensor_model_parallel_size", 1) or 1)
    vllm_weights = n * 2 / tp / GIB
    asleep = share if hybrid and not rollout.get("free_cache_engine", True) else 0.0
    vllm_idle = (("vLLM asleep", VLLM_ASLEEP_GIB),) if hybrid and not asleep else ()
    context = (("actor context", ACTOR_CONTEXT_GIB),)
    terms = pass_terms(cfg, vocab)

    def vocab_parts(name: str) -> tuple[tuple[str, float], ...]:
        return tuple((t.name, t.gib) for t in terms[name])

    resident = ((what, 0.0 if param_offload else params), ("AdamW", 0.0 if optimizer_offload else adam))
    train_tokens = _budget(cfg, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    logprob_tokens = _budget(cfg, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    found = []
    if hybrid:
        found.append(Pass("generation", (*resident, *context), vllm_share=share))
        if rank > 0:  # a PEFT model is staged whole for the sync
            model_parts = ((f"{what} staged", params),)
        else:  # FSDP2 gathers one tensor at a time (the LM head is the largest), cast to bf16
            model_parts = (resident[0], ("one gathered tensor", arch.vocab * arch.hidden * (base_bytes + 2) / GIB))
        found.append(Pass("weight sync", (("vLLM weights", vllm_weights), *model_parts, resident[1], *context)))
    found.append(
        Pass(
            "old-log-prob",
            ((f"{what} staged", params), resident[1], ("bf16 working copy", working),
             ("one layer's activations", _activations(arch, logprob_tokens)), *vocab_parts("old-log-prob"),
             *vllm_idle, *context),
            vllm_share=asleep,
        )
    )  # fmt: skip
    found.append(
        Pass(
            "training",
            ((f"{what} staged", params), ("gradients", grads), ("AdamW", adam), ("bf16 working copy", working),
             ("checkpointed layer inputs", arch.layers * train_tokens * arch.hidden * 2 / GIB),
             ("one layer's recompute", _activations(arch, train_tokens)), *vocab_parts("training"), *vllm_idle,
             *context),
            vllm_share=asleep,
        )
    )  # fmt: skip
    if not hybrid:
        found.append(Pass("rollout pool generation", (), vllm_share=share))
    return found


def kv_cache(cfg: DictConfig, arch, card: float) -> tuple[float, int]:
    """vLLM's KV cache on a card (GiB) and the full prompt + response sequences it holds per replica."""
    from gtpo.launch.state_memory import lora_parameters

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    tp = int(rollout.get("tensor_model_parallel_size", 1) or 1)
    rank = int(model.get("lora_rank", 0) or 0)
    lora_slot = lora_parameters(arch, rank, model.get("target_modules", "all-linear")) * 2 / tp / GIB if rank else 0
    weights = arch.parameters * 2 / tp / GIB
    kv = float(rollout.get("gpu_memory_utilization", 0.5)) * card - weights - VLLM_RUNTIME_GIB - lora_slot
    seq = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    return kv, max(int(kv * GIB * tp // (arch.kv_bytes_per_token * seq)), 0)


def largest_share(generation: Pass, card: float) -> float:
    """The largest ``gpu_memory_utilization`` whose generation pass fits ``card`` beside the actor's resident states."""
    return max((card - CARD_RESERVE_GIB - generation.total(card) + generation.vllm_share * card) / card, 0.0)


def _estimate(cfg: DictConfig):
    from gtpo.launch.memory_estimate import vocabulary
    from gtpo.launch.state_memory import architecture

    if str(_get(cfg, "trainer.device", "cuda")) == "cpu":
        return None, "the CPU backend (trainer.device=cpu)"
    arch, source = architecture(str(cfg.actor_rollout_ref.model.path))
    if arch is None:
        return None, source
    return (arch, passes(cfg, arch, vocabulary(cfg)[0])), source


def peak_problems(cfg: DictConfig) -> list[str]:
    """Why this run does not fit the GPUs it is sized for, by the estimate: a pass above a card's usable memory, or a
    vLLM share that holds less than one full sequence. Empty when it fits, or when the model is not known here."""
    found, _ = _estimate(cfg)
    if found is None:
        return []
    arch, run_passes = found
    seq = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    share_key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    fix = "set algorithm.hardware.gpu_memory_gib to your GPUs' memory if they are larger"
    problems = []
    for card in cards(cfg):
        usable = card - CARD_RESERVE_GIB
        for one in run_passes:
            if one.total(card) > usable:
                problems.append(
                    f"the {one.name} pass needs about {one.total(card):.1f} GiB per GPU, more than the {usable:g} GiB "
                    f"usable on a {card:g} GiB GPU ({one.describe(card)}); lower its token budget, offload "
                    f"(fsdp_config.param_offload / optimizer_offload), lower {share_key}, or {fix}"
                )
        kv, sequences = kv_cache(cfg, arch, card)
        if sequences < 1:
            problems.append(
                f"{share_key}={_get(cfg, share_key)} of a {card:g} GiB GPU leaves vLLM {kv:.1f} GiB of KV cache: not "
                f"one {seq:,}-token sequence beside its {arch.parameters * 2 / GIB:.1f} GiB of bf16 weights (is "
                f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path} the model this preset is sized "
                f"for?); raise it, or {fix}"
            )
    return problems


def peak_lines(cfg: DictConfig) -> list[str]:
    """The dry run's lines: each pass's peak per GPU on each card, and vLLM's KV cache and largest share there."""
    found, source = _estimate(cfg)
    if found is None:
        return [f"GPU peak per pass: not estimated ({source})"]
    arch, run_passes = found
    targets = cards(cfg)
    lines = [
        f"GPU peak per pass on the GPUs this run is sized for (algorithm.hardware.gpu_memory_gib="
        f"[{', '.join(f'{c:g}' for c in targets)}]; estimates: model states as staged, logits and entropy at the "
        f"budgets, allowances {ACTOR_CONTEXT_GIB:g} GiB actor context, {VLLM_ASLEEP_GIB:g} GiB vLLM asleep, "
        f"{VLLM_RUNTIME_GIB:g} GiB vLLM runtime; {CARD_RESERVE_GIB:g} GiB of each card unusable; not measured):"
    ]
    seq = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    for card in targets:
        usable = card - CARD_RESERVE_GIB
        for one in run_passes:
            verdict = "fits" if one.total(card) <= usable else "DOES NOT FIT"
            lines.append(f"  {card:g} GiB GPU, {one.describe(card)}: {verdict} ({usable:g} usable)")
        kv, sequences = kv_cache(cfg, arch, card)
        generation = next((p for p in run_passes if p.vllm_share and "generation" in p.name), None)
        largest = f"; the largest share that fits beside the actor: {largest_share(generation, card):.2f}"
        lines.append(
            f"  {card:g} GiB GPU, vLLM: {max(kv, 0):.1f} GiB of KV cache, {sequences} sequences of {seq:,} tokens per "
            f"replica" + (largest if generation is not None else "")
        )
    return lines
