"""What a launch runs: a method row, a model preset and an optional adapter, named by what changes the algorithm.

The launcher (:mod:`gtpo.launch.launcher`, ``scripts/run.sh METHOD MODEL``) reads this; so do the entry point's
check of the run folder (:func:`gtpo.launch.checks.check_run_folder`), the dry run's first line (:func:`facts`) and
the test that holds every published ``scripts/run_<method>_<model>.sh`` to its comments. Presets are read as files
(``configs/<group>/<name>.yaml``), without Hydra or verl: a launcher mistake is refused in a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

__all__ = ["CONFIGS", "RUN_ENV", "RUN_RECORD", "Run", "facts", "fitting_launcher", "missing_piece", "preset_counts",
           "presets", "published_script", "recorded_run", "run_identity"]  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "configs"
SCRIPTS = REPO_ROOT / "scripts"
RECIPE_CONFIG = REPO_ROOT / "recipe" / "gtpo" / "config" / "gtpo_trainer.yaml"
# The launcher's description of the run, handed to the entry point, and the record a run leaves in its folder.
RUN_ENV = "GTPO_RUN"
RUN_RECORD = "gtpo_run.json"
# Overrides that leave what is trained alone (where data, models and logs are, the cluster's shape, memory budgets,
# validation, checkpoint cadence, the trainer's own guards): they do not change a run's name.
RUN_ONLY_GROUPS = ("sampling",)
RUN_ONLY_PREFIXES = (
    "trainer.",
    "data.train_files",
    "data.val_files",
    "data.val_max_samples",
    "data.dataloader_num_workers",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.rollout.val_kwargs.",
    "actor_rollout_ref.rollout.checkpoint_engine.",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
    "algorithm.groups.",
    "algorithm.watchdog.",
    "algorithm.preemption.",
    "algorithm.resume.",
    "algorithm.hardware.",
    "ray_kwargs.",
    "transfer_queue.",
    "hydra.",
)
RUN_ONLY_LEAVES = re.compile(
    r"(max_token_len_per_gpu|micro_batch_size_per_gpu|use_dynamic_bsz|gpu_memory_utilization|_parallel_size|"
    r"max_num_batched_tokens|param_offload|optimizer_offload|enable_gradient_checkpointing|use_remove_padding|"
    r"entropy_from_logits_with_chunking|entropy_checkpointing|use_torch_compile|fsdp_size|enable_chunked_prefill|"
    r"enforce_eager|free_cache_engine|enable_prefix_caching|load_format|layered_summon|max_num_seqs)$|engine_kwargs\."
)
# Beyond this many characters the algorithm part of a run's name is cut and a hash of it appended.
NAME_SUFFIX_CHARS = 60


def presets(group: str) -> list[str]:
    """The presets of ``configs/<group>/`` (``model``, ``adapter``, ``scale``, ...), by name."""
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def read_preset(group: str, name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / group / f"{name}.yaml").read_text()) or {}


def default_choice(group: str) -> str | None:
    """The recipe's default for a preset group (its defaults list in ``gtpo_trainer.yaml``)."""
    for entry in yaml.safe_load(RECIPE_CONFIG.read_text()).get("defaults", []):
        if isinstance(entry, dict) and group in entry:
            return entry[group]
    return None


def missing_piece(group: str, choice: str, model: str) -> str | None:
    """Why ``model`` cannot run under ``<group>=<choice>``: the group's choice is sized per model
    (``configs/<group>/model/<choice>_<m>.yaml`` exist) but not for this one. None when nothing is missing."""
    sized = sorted(p.stem.removeprefix(f"{choice}_") for p in (CONFIGS / group / "model").glob(f"{choice}_*.yaml"))
    if not sized or model in sized:
        return None
    return (
        f"model={model} with {group}={choice}: no per-model piece configs/{group}/model/{choice}_{model}.yaml (the "
        f"{group} is sized per model; it has pieces for {', '.join(sized)})"
    )


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


def preset_counts(model: str, adapter: str | None, overrides: Sequence[str], environ: Mapping[str, str]):
    """``(nodes, GPUs per node)`` of the trainer: ``NNODES`` / ``NGPUS_PER_NODE``, else the command line's
    ``trainer.nnodes`` / ``trainer.n_gpus_per_node``, else the adapter's, else the model preset's."""
    pieces = [read_preset("model", model)] + ([read_preset("adapter", adapter)] if adapter else [])
    counts = []
    for key, var in (("nnodes", "NNODES"), ("n_gpus_per_node", "NGPUS_PER_NODE")):
        value = next((v for k, v in map(_split, reversed(overrides)) if k == f"trainer.{key}"), None)
        for piece in reversed(pieces):
            value = value if value is not None else (piece.get("trainer") or {}).get(key)
        counts.append(int(environ.get(var) or value or 1))
    return tuple(counts)


@dataclass(frozen=True)
class Run:
    """One launch: a method row, a model preset, an adapter, and the caller's overrides; ``smoke`` is the smoke
    run's two short phases (``configs/scale/smoke.yaml``)."""

    method: str
    model: str
    adapter: str | None = None
    overrides: tuple[str, ...] = ()
    smoke: bool = False

    @cached_property
    def changes(self) -> tuple[str, ...]:
        """The overrides that change what is trained, ``key=value`` sorted by key (the last of a key wins)."""
        found: dict[str, str] = {}
        for override in self.overrides:
            key, value = _split(override)
            if key in ("method", "model", "adapter") or key in RUN_ONLY_GROUPS:
                continue
            if key.startswith(RUN_ONLY_PREFIXES) or RUN_ONLY_LEAVES.search(key):
                continue
            found[key] = value
        if self.smoke:
            found.pop("scale", None)
        elif found.get("scale") == default_choice("scale"):
            del found["scale"]
        return tuple(f"{k}={found[k]}" for k in sorted(found))

    def name(self) -> str:
        """``<method>-<model>[-<adapter>]`` (``smoke-`` before it for the smoke run), then ``-<key>_<value>`` for each
        change (the key's last part), e.g. ``gtpo-qwen2.5-7b-norm_mode_split``."""
        base = f"{'smoke-' if self.smoke else ''}{self.method}-{self.model.replace('_', '-')}"
        base += f"-{self.adapter}" if self.adapter else ""
        labels = [f"{k.rpartition('.')[2]}_{v}" for k, v in map(_split, self.changes)]
        suffix = re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(labels)).strip("-")
        if len(suffix) > NAME_SUFFIX_CHARS:
            digest = hashlib.sha1("\n".join(self.changes).encode()).hexdigest()[:8]
            suffix = f"{suffix[: NAME_SUFFIX_CHARS - 9].rstrip('-_.')}-{digest}"
        return f"{base}-{suffix}" if suffix else base

    def identity(self, name: str) -> dict[str, Any]:
        """What :data:`RUN_ENV` carries and :data:`RUN_RECORD` keeps."""
        return {"name": name, "method": self.method, "model": self.model, "adapter": self.adapter,
                "changes": list(self.changes)}  # fmt: skip


def published_script(method: str, model: str, adapter: str | None = None) -> str | None:
    """``scripts/run_<method>_<model>[_<adapter>].sh`` when the repository publishes that run, else None."""
    path = SCRIPTS / f"run_{method}_{model}{f'_{adapter}' if adapter else ''}.sh"
    return str(path.relative_to(REPO_ROOT)) if path.is_file() else None


def fitting_launcher(method: str, model: str, adapter: str | None = None) -> str:
    """The command that runs ``method`` on ``model``: its published script, else the generic launcher."""
    published = published_script(method, model, adapter)
    if published:
        return f"bash {published}"
    return f"bash scripts/run.sh {method} {model}" + (f" adapter={adapter}" if adapter else "")


def run_identity(environ: Mapping[str, str]) -> dict[str, Any] | None:
    text = environ.get(RUN_ENV, "")
    return json.loads(text) if text else None


def recorded_run(folder: str) -> dict[str, Any] | None:
    """The :data:`RUN_RECORD` of a run folder, or None."""
    try:
        with open(os.path.join(folder, RUN_RECORD), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_record(folder: str, run: Mapping[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{RUN_RECORD}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dict(run), f, indent=1)
    os.replace(tmp, os.path.join(folder, RUN_RECORD))


def described(run: Mapping[str, Any]) -> str:
    words = [f"method={run.get('method')}", f"model={run.get('model')}"]
    words += [f"adapter={run['adapter']}"] if run.get("adapter") else []
    return " ".join(words + list(run.get("changes") or []))


def facts(config: Any) -> str:
    """The run's shape and method in the words the published scripts' comments use, e.g. ``1 node x 8 GPUs | no KL |
    dynamic sampling | clip 0.2/0.28 | loss vanilla/token-mean`` (tests/test_launch_scripts.py holds them to it)."""

    def get(key: str, default: Any = None) -> Any:
        return OmegaConf.select(config, key, default=default)

    actor = "actor_rollout_ref.actor"
    nodes, gpus = int(get("trainer.nnodes")), int(get("trainer.n_gpus_per_node"))
    words = [f"{nodes} node{'s' * (nodes > 1)} x {gpus} GPU{'s' * (gpus > 1)}"]
    if int(get("actor_rollout_ref.model.lora_rank", 0) or 0) > 0:
        words.append(f"LoRA r={get('actor_rollout_ref.model.lora_rank')}")
    if get(f"{actor}.use_kl_loss"):
        words.append(f"KL loss {get(f'{actor}.kl_loss_coef')}")
    elif get("algorithm.use_kl_in_reward"):
        words.append("KL in reward")
    else:
        words.append("no KL")
    words.append("dynamic sampling" if get("algorithm.filter_groups.enable", False) else "no dynamic sampling")
    if get("algorithm.forking.enable", False):
        words.append(f"forking tokens rho={get('algorithm.forking.rho')}")
    words.append(f"clip {get(f'{actor}.clip_ratio_low')}/{get(f'{actor}.clip_ratio_high')}")
    words.append(f"loss {get(f'{actor}.policy_loss.loss_mode', 'vanilla')}/{get(f'{actor}.loss_agg_mode')}")
    return " | ".join(words)
