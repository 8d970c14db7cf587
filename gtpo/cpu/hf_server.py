"""Server actor of the ``hf`` rollout: verl's server calls (generation, weights, controls) around :class:`HFSampler`.

Concurrent ``generate`` calls are collected for a few milliseconds and decoded together as one left-padded batch
with a KV cache (one forward per new token for the whole batch); a request that arrives during a batch waits for
the next one. Deviations from vLLM: no continuous batching, no prefix cache, no preemption, no LoRA adapters
(``lora.merge=True`` works because merged weights arrive as plain tensors), no multimodal input, no
``stop`` strings (token ids only); unknown sampling keys are reported once in the log.

Partial rollout (verl's async trainers): ``abort_all_requests`` closes the submission gate, ends the running batch
before its next token and answers every unfinished request with what it has and ``stop_reason="aborted"``;
verl's ``FullyAsyncLLMServerClient`` resubmits prompt + partial response, which waits at the gate until
``resume_generation`` (under ``reject_request=True`` it is answered at once as aborted, to be re-routed). The other
controls (``wake_up``, ``sleep``, the KV-cache calls, profiling) are no-ops on CPU because nothing is offloaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import torch

from gtpo.cpu.hf_sampler import GenRequest, GenResult, HFSampler

__all__ = ["HFRolloutServer", "load_causal_lm"]

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

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
        # Submission gate of partial rollout: set = open; closed by abort_all_requests until resume_generation.
        self._gate = asyncio.Event()
        self._gate.set()
        self._reject_requests = False

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
        # Imported here, not at the top: a Ray worker unpickling this actor imports this module first, and importing
        # verl then imports VERL_USE_EXTERNAL_MODULES, whose gtpo.cpu.hf_rollout imports this module back.
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data or audio_data:
            raise ValueError("the hf rollout does not support multimodal input (image/video/audio data given)")
        req = self.make_request(prompt_ids, sampling_params)
        while not self._gate.is_set():
            if self._reject_requests:  # as vLLM's server: an empty aborted answer tells the client to re-route
                return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted", num_preempted=0,
                                   extra_fields={"global_steps": self.global_steps})  # fmt: skip
            await self._gate.wait()
        future = asyncio.get_running_loop().create_future()
        self._queue.append((req, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        result, global_steps = await future
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            stop_reason="aborted" if result.finish_reason == "abort" else "completed",
            num_preempted=0,
            extra_fields={"global_steps": global_steps},
        )

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(_BATCH_COLLECT_S)
            batch, self._queue = self._queue, []
            version = self.global_steps  # weights cannot change during a batch (the sampler's lock)
            try:
                results = await asyncio.to_thread(self.sampler.generate, [req for req, _ in batch])
            except Exception as exc:  # deliver the error to every waiting request
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result((res, version))

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

    # -- partial rollout ------------------------------------------------------------------------------------------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate, cut the running batch short, answer every unfinished request as aborted."""
        self._gate.clear()
        self._reject_requests = bool(reject_request)
        queued, self._queue = self._queue, []
        for req, fut in queued:  # not started: nothing generated yet
            if not fut.done():
                fut.set_result((GenResult([], [] if req.logprobs else None, "abort"), self.global_steps))
        running = self._worker is not None and not self._worker.done()
        self.sampler.abort_event.set()
        try:
            if running:
                await self._worker
        finally:
            self.sampler.abort_event.clear()
        return {"aborted_count": len(queued) + int(running), "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id, "error": "hf rollout aborts all requests only"}

    async def resume_generation(self) -> None:
        """Resume after ``abort_all_requests``: resubmitted requests (and new ones) are generated again."""
        await self.open_submission_gate()

    async def open_submission_gate(self) -> None:
        self._reject_requests = False
        self._gate.set()

    # -- controls verl calls on every server; nothing to free on CPU ---------------------------------------------

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

    async def resume_engine_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None
