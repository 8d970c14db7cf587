"""verl rollout ``hf``: a transformers-based token-in/token-out server for CPU tests and demos (never for training).

verl 0.9.1 only wires ``vllm``, ``sglang`` and ``trtllm`` as rollout backends (``_ROLLOUT_REGISTRY`` in
``verl.workers.rollout.base`` and ``RolloutReplicaRegistry`` in ``verl.workers.rollout.replica``); none runs without
a GPU. Importing this module registers ``actor_rollout_ref.rollout.name=hf``:

* :class:`HFRolloutServer`, a Ray actor (``num_cpus=0``, named ``hf_server_<replica>_0``), holds a causal LM in
  float32 with SDPA attention and implements the server calls verl's agent loop, ``CheckpointEngineManager`` and
  v1 trainers make: ``generate`` (token ids in, :class:`TokenOutput` out), ``update_weights``,
  ``set_global_steps`` and the memory / scheduling controls (``wake_up``, ``sleep``, ``clear_kv_cache``,
  ``release_kv_cache``, ``resume_kv_cache``, ``abort_all_requests``, ``abort_request``, ``resume_generation``,
  ``resume_engine_generation``, ``open_submission_gate``, ``wait_for_requests_to_drain``, ``start_profile``,
  ``stop_profile``), which are no-ops on CPU because nothing is offloaded and generation is never preempted.
* :class:`HFReplica` (``RolloutReplica``) starts one server per replica (hybrid mode only: TP = PP = DP = 1).
* :class:`HFServerAdapter` (``BaseRollout``) lives in the hybrid actor worker; ``update_weights`` gathers the
  FSDP engine's ``(name, tensor)`` stream (HF state-dict keys, full tensors) into one CPU float32 dict and sends
  it to the replica's server, which loads it with ``load_state_dict(strict=False)``; ``lm_head.weight`` is tied to
  the embedding in Qwen2 small models and loads into the same storage.

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

Concurrent ``generate`` calls are collected for a few milliseconds and decoded together as one left-padded batch
with a KV cache (one forward per new token for the whole batch); a request that arrives during a batch waits for
the next one. Deviations from vLLM: no continuous batching, no prefix cache, no preemption, no LoRA adapters
(``lora.merge=True`` works because merged weights arrive as plain tensors), no multimodal input, no
``stop`` strings (token ids only); unknown sampling keys are reported once in the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

ROLLOUT_NAME = "hf"
SERVER_NAME_PREFIX = "hf_server_"
# Sampling keys understood by HFSampler; anything else is reported once.
_KNOWN_SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "logprobs",
    "max_tokens",
    "max_new_tokens",
    "seed",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
}
# How long the batcher waits after the first queued request so that siblings (GRPO's n samples) join its batch.
_BATCH_COLLECT_S = 0.005


# ---------------------------------------------------------------------------------------------------------------
# sampling core (plain torch): usable and testable on its own


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
    finish_reason: str  # "stop" (EOS / stop id) or "length"


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


# ---------------------------------------------------------------------------------------------------------------
# Ray server


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """Field of a dataclass / DictConfig / dict."""
    if isinstance(obj, dict):
        return obj.get(key, default)
    getter = getattr(obj, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:
            pass
    return getattr(obj, key, default)


def _eos_ids(tokenizer: Any, generation_config: Any) -> list[int]:
    ids: list[int] = []
    for src in (
        _get(generation_config, "eos_token_id") if generation_config is not None else None,
        getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None,
    ):
        if src is None:
            continue
        for t in src if isinstance(src, (list, tuple)) else [src]:
            if int(t) not in ids:
                ids.append(int(t))
    if not ids:
        raise ValueError("no EOS id found in the tokenizer or generation config")
    return ids


def load_causal_lm(path: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """float32, SDPA, eval mode, on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa", trust_remote_code=trust_remote_code
    )
    return model.eval()


class HFRolloutServer:
    """Server actor body (also usable without Ray, e.g. ``asyncio.run(server.generate(...))`` in tests).

    Args:
        config: rollout config (``RolloutConfig`` or the ``actor_rollout_ref.rollout`` DictConfig).
        model_config: ``HFModelConfig`` or the ``actor_rollout_ref.model`` DictConfig.
        replica_rank: replica index (seeds the shared generator).
        sampler: optional ready :class:`HFSampler` (skips loading ``model_config``).
    """

    def __init__(
        self,
        config: Any,
        model_config: Any = None,
        rollout_mode: Any = None,
        replica_rank: int = 0,
        node_rank: int = 0,
        sampler: HFSampler | None = None,
        **kwargs: Any,
    ):
        self.config = config
        self.replica_rank = int(replica_rank)
        self.node_rank = int(node_rank)
        self.rollout_mode = rollout_mode
        self.global_steps = None
        self.prompt_length = int(_get(config, "prompt_length", 512))
        self.response_length = int(_get(config, "response_length", 512))
        self._warned_keys: set[str] = set()
        if sampler is None:
            sampler = self._build_sampler(config, model_config)
        self.sampler = sampler
        self._queue: list[tuple[GenRequest, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    def _build_sampler(self, config: Any, model_config: Any) -> HFSampler:
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        if not isinstance(model_config, HFModelConfig):
            model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        model = load_causal_lm(model_config.local_path, trust_remote_code=model_config.trust_remote_code)
        tokenizer = model_config.tokenizer
        max_model_len = _get(config, "max_model_len") or (self.prompt_length + self.response_length)
        max_model_len = min(int(max_model_len), int(getattr(model.config, "max_position_embeddings", max_model_len)))
        pad = getattr(tokenizer, "pad_token_id", None)
        return HFSampler(
            model,
            eos_token_ids=_eos_ids(tokenizer, model_config.generation_config),
            max_model_len=max_model_len,
            logprobs_mode=_get(config, "logprobs_mode", "processed_logprobs") or "processed_logprobs",
            seed=int(_get(config, "seed", 0) or 0) + self.replica_rank,
            pad_token_id=pad if pad is not None else 0,
        )

    # -- generation ----------------------------------------------------------------------------------------------

    def make_request(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> GenRequest:
        """Translate verl's sampling params (vLLM names) into a :class:`GenRequest`."""
        params = dict(sampling_params or {})
        unknown = set(params) - _KNOWN_SAMPLING_KEYS - self._warned_keys
        if unknown:
            logger.warning("hf rollout ignores sampling params %s", sorted(unknown))
            self._warned_keys |= unknown
        prompt_ids = [int(t) for t in prompt_ids]
        if "max_tokens" in params and params["max_tokens"] is not None:
            max_tokens = int(params["max_tokens"])
        elif "max_new_tokens" in params and params["max_new_tokens"] is not None:
            max_tokens = int(params["max_new_tokens"])
        else:
            max_tokens = min(self.response_length, self.prompt_length + self.response_length - len(prompt_ids))
        room = self.sampler.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt length {len(prompt_ids)} leaves no room within max_model_len={self.sampler.max_model_len}"
            )
        max_tokens = max(1, min(max_tokens, room))
        temperature = params.get("temperature", 1.0)
        top_k = params.get("top_k", -1)
        return GenRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=float(1.0 if temperature is None else temperature),
            top_p=float(params.get("top_p", 1.0) or 1.0),
            top_k=int(-1 if top_k is None else top_k),
            repetition_penalty=float(params.get("repetition_penalty", 1.0) or 1.0),
            seed=params.get("seed"),
            logprobs=bool(params.get("logprobs", False)),
            ignore_eos=bool(params.get("ignore_eos", _get(self.config, "ignore_eos", False))),
            stop_token_ids=tuple(int(t) for t in (params.get("stop_token_ids") or ())),
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str = "",
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ):
        """Token-in/token-out generation; returns verl's ``TokenOutput``."""
        if image_data or video_data or audio_data:
            raise ValueError("the hf rollout does not support multimodal input (image/video/audio data given)")
        req = self.make_request(prompt_ids, sampling_params)
        future = asyncio.get_running_loop().create_future()
        self._queue.append((req, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        result: GenResult = await future
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps},
        )

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(_BATCH_COLLECT_S)
            batch, self._queue = self._queue, []
            try:
                results = await asyncio.to_thread(self.sampler.generate, [req for req, _ in batch])
            except Exception as exc:  # deliver the error to every waiting request
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)

    # -- weights -------------------------------------------------------------------------------------------------

    async def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load actor weights (HF keys). Returns the number of tensors loaded."""
        missing = await asyncio.to_thread(self.sampler.load_weights, state_dict)
        if missing:
            logger.warning(
                "hf rollout update_weights: %d model tensors were not sent, e.g. %s", len(missing), missing[:4]
            )
        if global_steps is not None:
            self.global_steps = global_steps
        return len(state_dict)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- controls verl calls on every server; nothing to free or pause on CPU ------------------------------------

    def get_server_address(self) -> tuple[str, int]:
        return "127.0.0.1", 0

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._queue or (self._worker is not None and not self._worker.done()):
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        # Batches run to completion (a few hundred ms on the tiny model); sync trainers never abort mid-rollout.
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id, "error": "hf rollout does not abort requests"}

    async def resume_generation(self) -> None:
        return None

    async def resume_engine_generation(self) -> None:
        return None

    async def open_submission_gate(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------------------------
# verl glue: replica (trainer side) and adapter (actor-worker side)


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    return f"{SERVER_NAME_PREFIX}{replica_rank}_{node_rank}"


class HFReplica(RolloutReplica):
    """One :class:`HFRolloutServer` per replica; hybrid mode only."""

    async def launch_servers(self):
        if self.rollout_mode != RolloutMode.HYBRID:
            raise NotImplementedError(f"the hf rollout supports hybrid mode only, got {self.rollout_mode}")
        if self.world_size != 1:
            raise ValueError(
                "the hf rollout needs tensor/data/pipeline parallel size 1 per replica, "
                f"got world size {self.world_size}"
            )
        name = server_actor_name(self.replica_rank)
        server = (
            ray.remote(HFRolloutServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
                node_rank=0,
            )
        )
        host, _ = await server.get_server_address.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{host}:{name}"


class HFServerAdapter(BaseRollout):
    """Hybrid-worker side of the hf rollout: forwards the actor's weights to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        """Gather ``(name, tensor)`` into a CPU float32 dict and send it to this replica's server."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout accepts wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError(
                "the hf rollout cannot apply LoRA adapters; set actor_rollout_ref.model.lora.merge=True"
            )
        state: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            state[name] = tensor.detach().to("cpu", torch.float32).clone()
        if self.rollout_rank != 0:
            return None
        await self._server_handle().update_weights.remote(state, global_steps=kwargs.get("global_steps"))
        return None

    def generate_sequences(self, prompts):
        raise NotImplementedError("the hf rollout serves generation through its server actor only")


def _load_hf_replica() -> type[RolloutReplica]:
    return HFReplica


def register() -> None:
    """Register ``hf`` in verl's two rollout registries (idempotent)."""
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_hf_replica)


register()
