"""verl's vLLM rollout on CPU, as a cluster launcher configures it, and a weight sync broken on purpose.

    .venv/bin/python -m pytest -q -m e2e tests/test_e2e_vllm.py

1. ``scripts/run_gtpo_qwen2.5_7b.sh trainer=colocate_async`` runs, through the launcher script itself, at world size
   two on the session cluster's two simulated nodes (``NNODES=2 NGPUS_PER_NODE=1``), with the launcher's own presets
   (method, the model preset's rollout block, scale, sampling, trainer mode). The CPU run replaces only what a CPU
   cannot have (model, lengths, batch and token budgets, GPU counts, the CPU backend's platform settings:
   ``CPU_REPLACED``) and adds a slice of ``scale=dapo``: Ulysses sequence parallelism 2, each sequence split over the
   two ranks, whose log-probs must still agree with vLLM's at every step. A dry run of both configurations checks
   that nothing else differs, so the launcher's sampling, chunked prefill, ``max_num_batched_tokens``,
   ``free_cache_engine``, ``load_format``, log-prob and dtype settings of vLLM run as set. Under ``colocate_async`` a
   batch is generated ahead while a step trains: the run checks where Ray placed it (one FSDP rank and one vLLM
   replica on each node), verl's pause in both replicas at every step, training on responses of the previous policy,
   the weights reaching vLLM at every sync and no shared memory left behind.
2. (slow tier) The same trainer at world size one with the vLLM patch that keeps the weights
   reloadable switched off (``VLLM_PLUGINS`` names only another plugin): the first weight sync fails in the vLLM
   worker, verl's sender waits on its socket, and the watchdog ends the run within
   ``algorithm.watchdog.weight_sync_s``, naming the stage.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.e2e import (
    actor_table,
    base_overrides,
    placement,
    read_metrics,
    run_recipe,
    tail,
)
from tests.support.launch import LAUNCHER, cpu_args, launcher_env, resolved_config

pytestmark = pytest.mark.e2e

LAUNCHER_ARGS = ["trainer=colocate_async"]

# Config keys the CPU run may differ in from the launcher's, by prefix, each for a reason the CPU imposes.
CPU_REPLACED = {
    # the tiny offline model, tokenizer and data
    "actor_rollout_ref.model.path": "tiny model",
    "actor_rollout_ref.model.tokenizer_path": "tiny model",
    "data.train_files": "tiny data",
    "data.val_files": "tiny data",
    "reward.custom_reward_function": "a coin-flip reward: mixed groups from a random model",
    "algorithm.filter_groups.enable": "no dynamic sampling: a random model gives few mixed groups",
    # lengths
    "data.max_prompt_length": "length",
    "data.max_response_length": "length",
    "actor_rollout_ref.rollout.prompt_length": "length",
    "actor_rollout_ref.rollout.response_length": "length",
    "actor_rollout_ref.rollout.max_model_len": "length",
    "reward.reward_kwargs.max_resp_len": "length",
    "reward.reward_kwargs.overlong_buffer_cfg.len": "length",
    "algorithm.grop.dapo_max_length": "length",
    # batch and token budgets
    "data.train_batch_size": "batch",
    "data.dataloader_num_workers": "batch",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "batch",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "batch",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "budget",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "batch",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "budget",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "batch",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "budget",
    # GPU counts and the CPU platform (configs/backend/cpu_tiny.yaml says why for each)
    "trainer.n_gpus_per_node": "GPU count",
    "trainer.nnodes": "GPU count",
    "actor_rollout_ref.rollout.n_gpus_per_node": "GPU count",
    "actor_rollout_ref.rollout.prometheus.served_model_name": "tiny model (vLLM serves it under its path)",
    "trainer.device": "CPU platform",
    "ray_kwargs": "one machine, fake GPU",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": "one machine",
    "reward.num_workers": "two cores",
    "actor_rollout_ref.rollout.agent.num_workers": "two cores",
    "actor_rollout_ref.model.override_config": "SDPA with Ulysses instead of flash-attention",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "scale=dapo's Ulysses, sliced to two ranks",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": "follows the actor's",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "follows the actor's",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": "follows the actor's",
    "actor_rollout_ref.ref.use_torch_compile": "follows the actor's",
    "critic.strategy": "FSDP1 needs an accelerator (no critic runs)",
    "critic.ppo_mini_batch_size": "batch (no critic runs)",
    "distillation.teacher_models.teacher_model.inference": "follows the rollout's dtype and lengths (distillation off)",
    "actor_rollout_ref.actor.use_torch_compile": "no inductor on the actor's CPU helpers",
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size": "16-token entropy chunks: chunking happens on tiny runs",
    "actor_rollout_ref.actor.fsdp_config.entropy_from_logits_chunk_size": "follows the actor's",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision": "fp32 training (no fast bf16 CPU kernels)",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision": "fp32 training",
    "actor_rollout_ref.rollout.enable_sleep_mode": "vLLM refuses sleep mode on CPU",
    "actor_rollout_ref.rollout.enforce_eager": "no torch.compile of the tiny model in vLLM",
    "actor_rollout_ref.rollout.dtype": "fp32 like the trainer",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes": "CPU KV cache size",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend": "no busy-waiting CPU worker",
    "actor_rollout_ref.actor.use_kl_loss": "no reference model on CPU",
    "algorithm.use_kl_in_reward": "no reference model on CPU",
    "algorithm.watchdog": "CPU stage deadlines",
    # a two-step test run
    "trainer.experiment_name": "the run's name follows the overrides that change the algorithm (the CPU backend's)",
    "actor_rollout_ref.rollout.trace.experiment_name": "the run's name (interpolated)",
    "trainer.total_training_steps": "test length",
    "trainer.val_before_train": "test length",
    "trainer.test_freq": "test length",
    "trainer.save_freq": "test length",
    "trainer.resume_mode": "test run",
    "trainer.logger": "test run",
    "trainer.v1.sampler.sampler_kwargs.poll_interval": "CPU steps take seconds",
}

# The launcher's vLLM settings that must reach the CPU run unchanged (checked by name, beyond the diff).
VLLM_AS_SET = (
    "n", "temperature", "top_p", "top_k", "calculate_log_probs", "enable_chunked_prefill", "max_num_batched_tokens",
    "free_cache_engine", "load_format", "gpu_memory_utilization", "enable_prefix_caching", "max_num_seqs",
)  # fmt: skip


def _flatten(node, prefix: str = "") -> dict[str, object]:
    """Dotted leaf keys of a nested dict (an empty mapping has no leaves)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _shm_segments() -> set[str]:
    """vLLM's (``psm_*``) and verl's weight-transfer (``verl_weights_*``) shared-memory segments now in /dev/shm."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("psm_*")} | {p.name for p in shm.glob("verl_weights_*")} if shm.is_dir() else set()


def _hydra(value) -> str:
    """A resolved config value as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _allowed(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in CPU_REPLACED)


@pytest.fixture(scope="module")
def demo_assets():
    from gtpo.cpu.demo import build_demo_assets

    return build_demo_assets(seed=0)


def _dry_config(tmp: Path, assets, args: list[str], extra_env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        ["bash", str(LAUNCHER), *args], cwd=tmp, env=launcher_env(tmp, assets, extra_env or {}), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return resolved_config(proc.stdout)


def test_launcher_rollout_settings_run_on_cpu_with_the_async_pause(ray_cluster, ray_session, demo_assets, tmp_path):
    from gtpo.cpu import env as cpu_env

    # the launcher's own settings, on a folder named as its model (the launcher refuses the tiny model's config.json
    # for the 7B preset; the CPU run below names the CPU backend, which runs the tiny model by design)
    (tmp_path / "Qwen2.5-7B").mkdir()
    launcher = _flatten(
        _dry_config(
            tmp_path, demo_assets, LAUNCHER_ARGS, {"MODEL_PATH": str(tmp_path / "Qwen2.5-7B"), "NGPUS_PER_NODE": "8"}
        )
    )
    # The launcher's vLLM settings, passed through after the backend preset (whose test sampling, n=4, gives way).
    vllm_as_set = [f"{k}={_hydra(launcher[k])}" for k in (f"actor_rollout_ref.rollout.{key}" for key in VLLM_AS_SET)]
    run_args = [*LAUNCHER_ARGS, *cpu_args(demo_assets), *vllm_as_set]
    # at the real run's two ranks: Ulysses 2 needs them
    cpu_run = _flatten(
        _dry_config(tmp_path, demo_assets, run_args, {**cpu_env(), "NNODES": "2", "ALLOW_HOME_PATHS": "1"})
    )
    differing = sorted(
        k for k in set(launcher) | set(cpu_run) if launcher.get(k, "<absent>") != cpu_run.get(k, "<absent>")
    )
    unexplained = [
        f"{k}: {launcher.get(k, '<absent>')!r} -> {cpu_run.get(k, '<absent>')!r}" for k in differing if not _allowed(k)
    ]
    assert not unexplained, "the CPU run changes launcher settings a CPU could run:\n" + "\n".join(unexplained)
    for key in VLLM_AS_SET:
        dotted = f"actor_rollout_ref.rollout.{key}"
        assert cpu_run[dotted] == launcher[dotted], dotted
    assert cpu_run["trainer.v1.trainer_mode"] == "gtpo_colocate_async" and cpu_run["actor_rollout_ref.rollout.n"] == 16

    # The real run, through the launcher script, joining the session's Ray cluster: one GPU on each of two nodes
    # (the launcher's path checks accept the asset cache under $HOME: both simulated nodes share this host's disk).
    # The file log is where the launcher puts it by default, under CKPTS_DIR (shared storage on a cluster), wherever
    # the TaskRunner lands: no path is given here.
    log_root = tmp_path / "ckpt" / "logs"
    metrics_path = log_root / str(cpu_run["trainer.project_name"]) / f"{cpu_run['trainer.experiment_name']}.jsonl"
    two_nodes = {"NNODES": "2", "NGPUS_PER_NODE": "1", "ALLOW_HOME_PATHS": "1"}
    env = launcher_env(tmp_path, demo_assets, {"RAY_ADDRESS": ray_cluster.address, **ray_cluster.auth_env, **two_nodes})
    env.pop("DRY_RUN")
    env.update({k: v for k, v in cpu_env(base=env).items()})
    env["VERL_LOGGING_LEVEL"] = "INFO"  # verl's server logs each abort with the number of requests it cut
    runtime_env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    args = [
        *run_args, "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
        "trainer.logger=[console,file]", f"{runtime_env}.VERL_LOGGING_LEVEL=INFO",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]  # fmt: skip
    log_path = tmp_path / "launcher.log"
    shm_before = _shm_segments()
    actors_before = actor_table()
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            ["bash", str(LAUNCHER), *args], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900
        )
    log_text = log_path.read_text(errors="replace")
    assert proc.returncode == 0, tail(log_text)
    assert sorted(log_root.rglob("*.jsonl")) == [metrics_path], sorted(log_root.rglob("*"))
    metrics = read_metrics(metrics_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4], tail(log_text)

    # Ray placed one FSDP rank and one vLLM replica on each node
    placed = placement(actors_before)
    assert len(set(placed["WorkerDict"])) == 2 and len(placed["WorkerDict"]) == 2, placed
    assert len(set(placed["vLLMHttpServer"])) == 2 and len(placed["vLLMHttpServer"]) == 2, placed
    nodes = {n["NodeID"] for n in ray_session.nodes() if n["Alive"]}
    assert set(placed["WorkerDict"]) == set(placed["vLLMHttpServer"]) == nodes, (placed, nodes)
    # the TaskRunner (the trackers' only writer) ran on one of them, in a working directory of Ray's choosing
    assert len(placed["GTPOTaskRunner"]) == 1 and set(placed["GTPOTaskRunner"]) <= nodes, placed
    # verl's vLLM server and engine generated (not a stand-in), with the launcher's sampling
    assert "vLLMHttpServer" in log_text and "EngineCore" in log_text
    assert all(m["data"]["response_length/min"] < m["data"]["response_length/max"] for m in metrics)
    # verl's pause protocol ran at every step: the server was asked to abort what was in flight when the trainer took
    # its batch (at this scale every group is complete by then: all requests run at once and end within 48 tokens,
    # so there is nothing to cut) ...
    aborts = re.findall(r"\(vLLMHttpServer pid=(\d+)[^)]*\).*Aborted (\d+) requests", log_text)
    per_server = {pid: sum(1 for p, _ in aborts if p == pid) for pid, _ in aborts}
    assert len(per_server) == 2 and set(per_server.values()) == {len(metrics)}, (
        f"one pause per step in each replica expected, the servers logged {aborts}"
    )
    # ... and the trainer trained on responses generated ahead by the previous policy (the async path, not sync's)
    assert max(m["data"]["gtpo/trajectory_staleness_max"] for m in metrics) >= 1, [m["data"] for m in metrics]
    # GTPO's estimator ran on the async path, with the old policy's entropy (a random model's is far from 0) and
    # verl's off-policy metrics mirrored beside its own
    for m in metrics:
        data = m["data"]
        assert {"gtpo/adv_pos_mean", "gtpo/conservation_err", "gtpo/trajectory_staleness_max"} <= set(data)
        assert data["gtpo/entropy_correct_mean"] > 1.0 or data["gtpo/entropy_incorrect_mean"] > 1.0
    # the estimator's kernel compiled (or loaded from numba's disk cache) in the first step of the process, only then
    compile_s = [m["data"].get("gtpo/kernel_compile_s") for m in metrics]
    assert compile_s[0] is not None and compile_s[0] > 0 and compile_s[1:] == [None] * 3, compile_s
    # the run left no shared memory behind (gtpo.cpu.vllm_patches, patch 3)
    assert _shm_segments() <= shm_before, sorted(_shm_segments() - shm_before)
    # the weights reached the server at every sync: rollout and trainer log-probs agree
    for m in metrics:
        assert m["data"]["training/rollout_actor_probs_pearson_corr"] > 0.99, m["data"]


@pytest.mark.slow  # the default tier stalls a weight sync under separate_async (tests/test_e2e_separate_async.py)
def test_a_broken_weight_sync_fails_within_its_limit_naming_the_stage(ray_cluster, tiny_assets, tmp_path):
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        pytest.skip("this vLLM CPU build packs no weights away (no oneDNN), so switching the patch off breaks nothing")
    limit = 30
    overrides = base_overrides(tiny_assets) + [
        "method=gtpo",
        "algorithm.filter_groups.enable=false",
        f"algorithm.watchdog.weight_sync_s={limit}",
        "algorithm.watchdog.grace_s=30",
        # every vLLM plugin but the recipe's: vLLM packs the fp32 linear weights away and the first sync breaks
        "+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_PLUGINS=lora_filesystem_resolver",
    ]
    shm_before = _shm_segments()
    start = time.monotonic()
    result = run_recipe(ray_cluster, tmp_path, overrides, timeout=600, name="broken_sync")
    elapsed = time.monotonic() - start
    # Without the recipe's vLLM plugin nothing unlinks vLLM's segments, and the stopped sender leaves its bucket.
    for name in _shm_segments() - shm_before:
        Path("/dev/shm", name).unlink(missing_ok=True)
    assert result.returncode not in (0, -9), f"the run did not fail on its own (rc={result.returncode})"
    log = result.log
    assert "AttributeError: 'Parameter' object has no attribute 'weight_loader'" in log, tail(log)
    assert re.search(r"gtpo watchdog: stage 'weight sync \(update_weights\)' made no progress for \d+ s", log), tail(
        log
    )
    assert "StageTimeoutError" in log and f"algorithm.watchdog.weight_sync_s={limit}" in log
    assert elapsed < 420, f"the broken run took {elapsed:.0f} s"
    assert not result.metrics  # it never trained
