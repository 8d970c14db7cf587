"""The vocabulary-sized terms of the actor's peak memory per GPU, from a resolved config (printed by the dry run).

At a 152,064-entry vocabulary the logits dominate what a micro-batch adds to the fixed states (parameters, gradients,
Adam, checkpointed layer inputs): each is ``tokens x vocabulary x bytes x copies``, with the token budget of the
pass (``ppo_max_token_len_per_gpu`` for training, ``log_prob_max_token_len_per_gpu`` for the old-log-prob pass).
What sets the copies in verl 0.9.1's FSDP engine (``workers/engine/fsdp/transformer_impl.py``):

* the logits are bf16; flash-attn's cross-entropy writes their gradient in place, except when the pass computes
  the entropy (``calculate_entropy``), which keeps logits and gradient apart (2 copies instead of 1);
* the entropy is computed in fp32 chunks of ``entropy_from_logits_chunk_size`` tokens; a chunk in flight holds its
  fp32 copy, the softmax and one temporary (3 copies of the chunk, freed chunk by chunk when nothing needs their
  gradient: the old-log-prob pass, or a checkpointed entropy that is never backpropagated);
* an entropy that is backpropagated (any ``entropy_coeff``, even 0, since verl's loss multiplies it in) keeps the
  fp32 copy and the softmax of every chunk for the backward: ``tokens x vocabulary x 4 B x 2`` (measured on CPU by
  tests/test_entropy_compile.py), and its gradient is a third logits copy. The forking loss detaches the entropy
  when ``entropy_coeff == 0`` (:mod:`gtpo.verl_plugin.actor_loss`), so with ``entropy_checkpointing`` that recompute
  never runs.

These are estimates from the code, not GPU measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

__all__ = ["GIB", "QWEN25_VOCAB", "Term", "memory_lines", "pass_terms", "vocabulary"]

GIB = 2**30
# vocab_size of Qwen2.5-7B and Qwen2.5-32B (config.json), assumed when the model folder is not readable here.
QWEN25_VOCAB = 152_064
LOGITS_BYTES = 2  # bf16
CHUNK_BYTES = 4  # fp32


@dataclass(frozen=True)
class Term:
    """One ``tokens x vocabulary x bytes x copies`` term."""

    name: str
    tokens: int
    vocab: int
    nbytes: int
    copies: int
    why: str

    @property
    def gib(self) -> float:
        return self.tokens * self.vocab * self.nbytes * self.copies / GIB

    def __str__(self) -> str:
        return (
            f"{self.name} {self.tokens:,} x {self.vocab:,} x {self.nbytes} B x {self.copies} = {self.gib:.1f} GiB "
            f"({self.why})"
        )


def vocabulary(cfg: DictConfig) -> tuple[int, str]:
    """The model's vocabulary size and where it came from (its config.json, or the Qwen2.5 value assumed)."""
    path = Path(str(cfg.actor_rollout_ref.model.path)).expanduser() / "config.json"
    try:
        vocab = json.loads(path.read_text())["vocab_size"]
        if isinstance(vocab, int) and vocab > 0:
            return vocab, f"vocab_size of {path}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from gtpo.launch.state_memory import KNOWN_MODELS

    known = KNOWN_MODELS.get(path.parent.name)
    if known is not None:
        return known.vocab, f"{path.parent.name}'s, by the folder's name: no readable {path}"
    return QWEN25_VOCAB, f"Qwen2.5-7B / 32B's, assumed: no readable {path}"


def _budget(cfg: DictConfig, key: str) -> int:
    """Tokens of one micro-batch: the dynamic-batch budget, else micro-batch size x the longest sequence."""
    actor = cfg.actor_rollout_ref.actor
    if actor.use_dynamic_bsz:
        return int(OmegaConf.select(cfg, key))
    micro_key = {
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
        ),
    }[key]
    seq = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    return int(OmegaConf.select(cfg, micro_key) or 1) * seq


def pass_terms(cfg: DictConfig, vocab: int) -> dict[str, list[Term]]:
    """``{"training": [...], "old-log-prob": [...]}``: the vocabulary-sized terms of each pass per GPU."""
    from gtpo.methods import knob

    actor = cfg.actor_rollout_ref.actor
    chunking = bool(actor.get("entropy_from_logits_with_chunking", False))
    chunk_size = int(actor.get("entropy_from_logits_chunk_size", 2048) or 2048)
    entropy_coeff = float(actor.get("entropy_coeff", 0.0) or 0.0)
    with_entropy = bool(actor.get("calculate_entropy", False)) or entropy_coeff != 0.0
    forking = knob(cfg.algorithm, "forking")
    entropy_grad = with_entropy and not (forking.enable and entropy_coeff == 0.0)

    def chunk_term(tokens: int, why: str) -> Term:
        rows = min(chunk_size, tokens) if chunking else tokens
        name = "entropy chunk" if chunking else "entropy (unchunked)"
        return Term(name, rows, vocab, CHUNK_BYTES, 3, why)

    train_tokens = _budget(cfg, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    training: list[Term] = []
    if not with_entropy:
        training.append(Term("logits", train_tokens, vocab, LOGITS_BYTES, 1, "gradient written in place"))
    else:
        copies = 3 if entropy_grad else 2
        why = "logits + gradient" + (" + the entropy's gradient" if entropy_grad else "")
        training.append(
            Term("logits", train_tokens, vocab, LOGITS_BYTES, copies, f"{why}: calculate_entropy, no in-place backward")
        )
        if entropy_grad:
            training.append(
                Term(
                    "entropy kept for its backward",
                    train_tokens,
                    vocab,
                    CHUNK_BYTES,
                    2,
                    "fp32 copy + softmax of every chunk: the loss backpropagates through the entropy",
                )
            )
        else:
            training.append(chunk_term(train_tokens, "transient, forward only: the forking loss detaches the entropy"))
    logprob_tokens = _budget(cfg, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    old_log_prob = [
        Term("logits", logprob_tokens, vocab, LOGITS_BYTES, 1, "no backward"),
        chunk_term(logprob_tokens, "transient: verl always computes the entropy in this pass"),
    ]
    return {"training": training, "old-log-prob": old_log_prob}


def memory_lines(cfg: DictConfig) -> list[str]:
    """The dry run's memory lines for a resolved config."""
    vocab, source = vocabulary(cfg)
    lines = [
        f"memory estimate per GPU, vocabulary-sized terms (tokens x vocabulary x bytes x copies; vocabulary "
        f"{vocab:,}: {source}); not measured:"
    ]
    for name, terms in pass_terms(cfg, vocab).items():
        lines.append(f"  {name} micro-batch: " + "; ".join(str(t) for t in terms))
    return lines
