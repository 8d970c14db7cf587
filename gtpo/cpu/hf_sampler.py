"""Sampling core of the ``hf`` rollout (plain torch, no verl, no Ray): batched KV-cache decoding for a causal LM.

Sampling follows vLLM's semantics as verl configures it: ``max_tokens`` (or ``max_new_tokens``) from the request,
else ``min(response_length, prompt_length + response_length - len(prompt))``, clamped to the model length; stop at
any EOS id of the tokenizer / generation config (the EOS token is returned, as vLLM does) unless ``ignore_eos``;
``temperature == 0`` is greedy. Returned log-probs follow ``rollout.logprobs_mode``: ``processed_logprobs`` (verl's
default) = log-softmax of the logits after repetition penalty, temperature, top-k and top-p, i.e. exactly the
distribution the token was drawn from, which equals the actor's ``log_softmax(logits / T)`` when top-k/top-p are
off; ``raw_logprobs`` = log-softmax of the unmodified logits. Greedy rows report the raw log-probs (temperature 1).
Log-probs are only returned when the request asks for them (``logprobs`` true, i.e. ``rollout.calculate_log_probs``).
A request ``seed`` gives it its own ``torch.Generator`` (same seed + same prompt + same weights = same tokens);
unseeded rows draw from one server generator seeded with ``rollout.seed + replica_rank``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

__all__ = ["GenRequest", "GenResult", "HFSampler"]


@dataclass
class GenRequest:
    """One generation request. ``top_k <= 0`` and ``top_p >= 1`` disable those filters; ``temperature == 0`` is
    greedy."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("prompt_ids=[]: need at least one prompt token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty}: must be > 0")


@dataclass
class GenResult:
    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str  # "stop" (EOS / stop id), "length", or "abort" (cut short by ``HFSampler.abort_event``)


@dataclass
class _Row:
    req: GenRequest
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    done: bool = False
    finish_reason: str = "length"


class HFSampler:
    """Batched token-by-token sampling with a KV cache for a transformers causal LM.

    Args:
        model: causal LM (put in eval mode here); any dtype, logits are processed in float32.
        eos_token_ids: ids that end a response (included in the output).
        max_model_len: prompt + response limit.
        logprobs_mode: ``processed_logprobs`` or ``raw_logprobs`` (see module docstring).
        seed: seed of the generator used by requests without their own seed.
        pad_token_id: id written into left padding (masked out, any valid id works).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: list[int] | tuple[int, ...],
        max_model_len: int,
        logprobs_mode: str = "processed_logprobs",
        seed: int = 0,
        pad_token_id: int = 0,
    ):
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError(
                f"logprobs_mode={logprobs_mode!r}: the hf rollout supports processed_logprobs, raw_logprobs"
            )
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 2")
        self.model = model.eval()
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len)
        self.logprobs_mode = logprobs_mode
        self.pad_token_id = int(pad_token_id)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.lock = threading.Lock()
        # Set from another thread to end the running batch before its next token (partial rollout's abort): the
        # unfinished rows return what they have with finish_reason "abort".
        self.abort_event = threading.Event()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- logits processing ---------------------------------------------------------------------------------------

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
        """vLLM/HF rule on tokens already in prompt or output: positive logits / p, negative logits * p.

        logits [B, V], seen [B, V] bool, penalty [B, 1]."""
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        return torch.where(seen, penalised, logits)

    @staticmethod
    def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Mask (-inf) tokens outside each row's top-k and nucleus. logits [B, V], top_k [B] (<=0 off), top_p [B]."""
        vocab = logits.shape[-1]
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        use_k = bool((k < vocab).any())
        use_p = bool((top_p < 1).any())
        if not (use_k or use_p):
            return logits
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= k.unsqueeze(1)
        if use_p:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold stays).
            mass_before = probs.cumsum(dim=-1) - probs
            drop = drop | (mass_before >= top_p.unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)

    def process_logits(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        greedy: torch.Tensor,
    ) -> torch.Tensor:
        """Sampling distribution's logits. logits [B, V] float32; temperature/top_p [B] float, top_k [B] int,
        greedy [B] bool (greedy rows keep temperature 1 and no filtering)."""
        temp = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        out = logits / temp
        k = torch.where(greedy, torch.full_like(top_k, -1), top_k)
        p = torch.where(greedy, torch.ones_like(top_p), top_p)
        return self._apply_top_k_top_p(out, k, p)

    # -- generation ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Decode all requests together; rows finish independently."""
        if not requests:
            return []
        with self.lock:
            return self._generate(requests)

    def _generate(self, requests: list[GenRequest]) -> list[GenResult]:
        device = self.device
        bsz = len(requests)
        rows = []
        for req in requests:
            if len(req.prompt_ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt length {len(req.prompt_ids)} leaves no room within max_model_len={self.max_model_len}"
                )
            gen = torch.Generator().manual_seed(int(req.seed)) if req.seed is not None else None
            rows.append(_Row(req=req, generator=gen))
        max_new = [min(r.req.max_tokens, self.max_model_len - len(r.req.prompt_ids)) for r in rows]

        temperature = torch.tensor([float(r.req.temperature) for r in rows], device=device)
        greedy = temperature == 0
        top_k = torch.tensor([int(r.req.top_k) for r in rows], device=device)
        top_p = torch.tensor([float(r.req.top_p) for r in rows], device=device)
        rep = torch.tensor([float(r.req.repetition_penalty) for r in rows], device=device).unsqueeze(1)
        use_rep = bool((rep != 1).any())

        # Left-pad prompts; positions count real tokens only.
        plen = max(len(r.req.prompt_ids) for r in rows)
        input_ids = torch.full((bsz, plen), self.pad_token_id, dtype=torch.long, device=device)
        attn = torch.zeros((bsz, plen), dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            n = len(r.req.prompt_ids)
            input_ids[i, plen - n :] = torch.tensor(r.req.prompt_ids, dtype=torch.long)
            attn[i, plen - n :] = 1
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        seen = None
        if use_rep:
            seen = torch.zeros((bsz, self._vocab_size()), dtype=torch.bool, device=device)
            seen.scatter_(1, input_ids, attn.bool())

        past = None
        step_ids, step_pos = input_ids, position_ids
        for _ in range(max(max_new)):
            if self.abort_event.is_set():
                for r in rows:
                    if not r.done:
                        r.done, r.finish_reason = True, "abort"
                break
            out = self.model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=step_pos,
                past_key_values=past,
                use_cache=True,
                logits_to_keep=1,
            )
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            if use_rep:
                logits = self._apply_repetition_penalty(logits, seen, rep)
            processed = self.process_logits(logits, temperature, top_k, top_p, greedy)
            logp = processed.log_softmax(dim=-1)
            next_ids = self._sample(logp, greedy, rows)
            if self.logprobs_mode == "raw_logprobs":
                chosen = out.logits[:, -1, :].float().log_softmax(dim=-1).gather(1, next_ids.unsqueeze(1))
            else:
                chosen = logp.gather(1, next_ids.unsqueeze(1))
            chosen = chosen.squeeze(1).tolist()
            ids_list = next_ids.tolist()
            for i, r in enumerate(rows):
                if r.done:
                    continue
                tok = ids_list[i]
                r.tokens.append(tok)
                r.logps.append(chosen[i])
                stop_ids = r.req.stop_token_ids if r.req.ignore_eos else self.eos_token_ids + r.req.stop_token_ids
                if tok in stop_ids:
                    r.done, r.finish_reason = True, "stop"
                elif len(r.tokens) >= max_new[i]:
                    r.done, r.finish_reason = True, "length"
            if all(r.done for r in rows):
                break
            step_ids = next_ids.unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=device)], dim=1)
            if use_rep:
                seen.scatter_(1, step_ids, True)

        return [
            GenResult(
                token_ids=r.tokens,
                log_probs=r.logps if r.req.logprobs else None,
                finish_reason=r.finish_reason,
            )
            for r in rows
        ]

    def _vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def _sample(self, logp: torch.Tensor, greedy: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        """Next token per row: argmax for greedy rows, else inverse-CDF sampling from exp(logp) with one uniform per
        row, drawn from the row's own generator (seeded requests) or the shared one. logp [B, V] -> ids [B]."""
        sample_rows = [i for i in range(len(rows)) if not bool(greedy[i])]
        next_ids = logp.argmax(dim=-1) if len(sample_rows) < len(rows) else torch.zeros(len(rows), dtype=torch.long)
        if not sample_rows:
            return next_ids
        u = torch.empty(len(sample_rows), dtype=torch.float64)
        shared = [j for j, i in enumerate(sample_rows) if rows[i].generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        for j, i in enumerate(sample_rows):
            if rows[i].generator is not None:
                u[j] = torch.rand(1, generator=rows[i].generator, dtype=torch.float64)
        idx = torch.tensor(sample_rows, device=logp.device)
        sub = logp if len(sample_rows) == len(rows) else logp[idx]
        cdf = sub.exp().double().cumsum(dim=-1)
        # Scale by the total so float rounding never leaves u above the last cdf value.
        target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
        picked = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=logp.shape[-1] - 1)
        # Float rounding could land on a filtered (zero-probability) token; fall back to the row's mode then.
        logp_at = sub.gather(1, picked.unsqueeze(1)).squeeze(1)
        if bool(torch.isinf(logp_at).any()):
            picked = torch.where(torch.isinf(logp_at), sub.argmax(dim=-1), picked)
        next_ids[idx] = picked
        return next_ids

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> list[str]:
        """Copy weights in (float32, strict=False). Returns the model keys that were not provided; raises on keys the
        model does not have, since silently ignoring them would keep stale weights."""
        own = self.model.state_dict()
        unexpected = sorted(k for k in state_dict if k not in own)
        if unexpected:
            raise ValueError(f"update_weights: keys not in the rollout model: {unexpected[:8]}")
        with self.lock:
            result = self.model.load_state_dict(
                {k: v.to(dtype=own[k].dtype) for k, v in state_dict.items()}, strict=False
            )
            # Tied lm_head / embedding share storage: providing either updates both.
            tied = getattr(self.model.config, "tie_word_embeddings", False)
            missing = [k for k in result.missing_keys if not (tied and k == "lm_head.weight")]
        return missing
