"""The one-GPU LoRA presets (configs/adapter/lora.yaml, configs/adapter/model/lora_<model>.yaml) and their launchers,
scripts/run_gtpo_<model>_lora.sh: what they resolve to, the dry run they pass, every method composing with
adapter=lora, and a model without its piece refused by name.

    .venv/bin/python -m pytest -q tests/test_lora_presets.py
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from gtpo.launch.runs import CONFIGS, missing_piece, presets, read_preset
from gtpo.methods import METHODS
from tests.support.configs import compose
from tests.support.e2e import REPO_ROOT
from tests.support.launch import dry_run_env, resolved_config

# The models the adapter is sized for, and the folder name of each (the model preset's hub id).
LORA_MODELS = sorted(p.stem.removeprefix("lora_") for p in (CONFIGS / "adapter" / "model").glob("lora_*.yaml"))
FOLDERS = {m: read_preset("model", m)["actor_rollout_ref"]["model"]["path"].rpartition("/")[2] for m in LORA_MODELS}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("lora_dry")
    env = dry_run_env(tmp)

    def run(model):
        cmd = ["bash", str(REPO_ROOT / "scripts" / f"run_gtpo_{model}_lora.sh")]
        return model, subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, LORA_MODELS))


@pytest.mark.parametrize("model", LORA_MODELS)
def test_the_lora_launcher_dry_run_is_one_gpu_with_the_papers_adapter(dry_runs, model):
    result, model_name = dry_runs[model], model
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "[dry run] OK" in result.stdout
    cfg = resolved_config(result.stdout)
    model, actor, rollout = (cfg["actor_rollout_ref"][k] for k in ("model", "actor", "rollout"))
    assert (cfg["trainer"]["nnodes"], cfg["trainer"]["n_gpus_per_node"]) == (1, 1)
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"]) == (128, 128, "all-linear")
    assert model["path"].endswith(f"/models/{FOLDERS[model_name]}")
    assert actor["optim"]["lr"] == pytest.approx(1e-5) and actor["fsdp_config"]["param_offload"] is True
    assert (rollout["load_format"], rollout["layered_summon"], rollout["tensor_model_parallel_size"]) == (
        "safetensors",
        True,
        1,
    )
    # paper A's batch and lengths, on one GPU
    assert cfg["data"]["train_batch_size"] == 128 and rollout["n"] == 16
    assert (
        "[dry run] resources: 1 node(s) x 1 GPU(s) = 1; ulysses sp=1 -> dp=1; vLLM replicas=1 (tp=1)" in result.stdout
    )
    frozen = r"frozen base (\d+\.\d+) B x 4 B / 1 rank\(s\) = (\d+\.\d) GB on the host memory between passes"
    state = re.search(r"\[dry run\]   actor \(LoRA r=128\): " + frozen, result.stdout)
    assert state, result.stdout[-3000:]
    assert float(state.group(2)) == pytest.approx(float(state.group(1)) * 4, abs=0.1)
    assert "vLLM (tp=1): bf16 weights" in result.stdout


@pytest.mark.parametrize("model", LORA_MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_composes_with_the_lora_adapter(method, model):
    cfg = compose([f"method={method}", f"model={model}", "adapter=lora"])
    piece = read_preset("adapter/model", f"lora_{model}")["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"]
    assert cfg.actor_rollout_ref.model.lora_rank == 128 and cfg.trainer.n_gpus_per_node == 1
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == piece  # the model's one-GPU piece


@pytest.mark.parametrize("model", sorted(set(presets("model")) - set(LORA_MODELS)))
def test_a_model_without_its_lora_piece_is_refused_by_name(model):
    """The piece is `optional` in the recipe's defaults list: Hydra would compose without it, silently."""
    assert missing_piece("adapter", "lora", model) == (
        f"model={model} with adapter=lora: no per-model piece configs/adapter/model/lora_{model}.yaml (the adapter "
        f"is sized per model; it has pieces for {', '.join(LORA_MODELS)})"
    )


def test_an_unknown_adapter_is_refused_at_composition():
    with pytest.raises(Exception, match="adapter/qlora"):
        compose(["method=gtpo", "model=qwen2.5_7b", "adapter=qlora"])


def test_the_demo_trains_lora_adapters_with_one_flag():
    """``python -m gtpo.cpu.demo --lora-rank R``: the CPU backend's run with rank-R adapters (alpha = R) on every
    linear layer; a rank below 1 is refused."""
    from gtpo.cpu.demo_trainer import lora_overrides

    cfg = compose(["backend=cpu_tiny", *lora_overrides(4)])
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (4, 4, "all-linear")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="must be a positive int"):
            lora_overrides(bad)


LORA_7B = ["method=gtpo", "model=qwen2.5_7b", "adapter=lora"]


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer=separate_async", "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"],
        ["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
        ["trainer=colocate_async", "actor_rollout_ref.rollout.checkpoint_engine.backend=nixl"],
    ],
    ids=["separate_async", "sync-nccl", "colocate_async-nixl"],
)
def test_lora_is_refused_where_verl_does_not_send_the_adapter(overrides):
    """verl 0.9.1's non-naive engines send the base weights without the lora_ tensors and no PEFT config: vLLM would
    sample from the frozen base while the actor trains the adapter."""
    from gtpo.launch.checks import check_lora_weight_sync

    cfg = compose([*LORA_7B, *overrides])
    with pytest.raises(ValueError, match=r"lora_rank=128 with actor_rollout_ref\.rollout\.checkpoint_engine\.backend="):
        check_lora_weight_sync(cfg)


@pytest.mark.parametrize("trainer", ["sync", "colocate_async"])
def test_lora_is_kept_on_the_naive_sync(trainer):
    """The two modes the LoRA end-to-end runs prove (tests/test_e2e_lora.py: rollout vs actor log-probs every step)."""
    from gtpo.launch.checks import check_lora_weight_sync

    cfg = compose([*LORA_7B, f"trainer={trainer}"])
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    check_lora_weight_sync(cfg)


def test_the_lora_launcher_refuses_separate_async_before_ray(tmp_path):
    env = dry_run_env(tmp_path)
    cmd = ["bash", str(REPO_ROOT / "scripts" / "run_gtpo_qwen2.5_7b_lora.sh"), "trainer=separate_async",
           "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert "verl 0.9.1 sends LoRA adapters to vLLM only through the naive in-process sync" in result.stderr
    assert "[dry run] OK" not in result.stdout
