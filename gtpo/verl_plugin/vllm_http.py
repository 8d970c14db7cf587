"""verl's vLLM HTTP servers, narrowed: what Ray's token does not cover (docs/cluster.md, "Security").

Each rollout replica's ``vLLMHttpServer`` serves vLLM's OpenAI API on the node's address, without a key, and verl's
runtime env sets ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``, which mounts ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``. verl itself never calls that API: the agent loop reaches each server through its Ray
actor handle, and LoRA adapters reach vLLM through verl's own weight sync (``engine.add_lora`` after each step). So
the entry point puts into the Ray runtime env (:func:`runtime_env_vars`, unless the runtime env sets them):

* ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=false``: no adapter can be loaded or swapped over HTTP;
* :data:`PRIVATE_API_FLAG` ``=1``, unless a reward model is enabled (verl's reward loop calls its vLLM server over
  HTTP): every process that imports verl then gives its own vLLM a random ``VLLM_API_KEY`` that nobody is told
  (:func:`lock_api`, run by :mod:`gtpo.verl_plugin.register`), so vLLM answers ``/v1/...`` with 401 to everyone. A
  key set by the user (``VLLM_API_KEY`` in the runtime env, for clients of their own) is kept. The value never
  leaves the process: not in the runtime env (the dashboard returns it), not on a command line (verl prints the
  server's arguments).

Left open by vLLM's design: the unguarded routes (``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``), which
run no generation and load nothing.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["PRIVATE_API_FLAG", "lock_api", "runtime_env_vars"]

PRIVATE_API_FLAG = "GTPO_VLLM_PRIVATE_API"


def runtime_env_vars(config: Any, env_vars: Mapping[str, str]) -> dict[str, str]:
    """What the run's Ray runtime env gains for vLLM's HTTP servers (none of what ``env_vars`` already sets)."""
    from omegaconf import OmegaConf

    wanted = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}
    if not OmegaConf.select(config, "reward.reward_model.enable", default=False):
        wanted[PRIVATE_API_FLAG] = "1"
    return {key: value for key, value in wanted.items() if key not in env_vars}


def lock_api(environ: MutableMapping[str, str] | None = None) -> bool:
    """In a process of a run that asked for it (:data:`PRIVATE_API_FLAG`), a random ``VLLM_API_KEY`` unless one is
    set; True when it set one."""
    environ = os.environ if environ is None else environ
    if environ.get(PRIVATE_API_FLAG) != "1" or environ.get("VLLM_API_KEY"):
        return False
    environ["VLLM_API_KEY"] = secrets.token_hex(32)
    return True
