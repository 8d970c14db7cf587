"""Each pass's GPU peak on the GPUs a run is sized for (gtpo.launch.gpu_peak), the refusals before Ray, and the
one-GPU LoRA presets that the estimate sizes.

    .venv/bin/python -m pytest -q tests/test_gpu_peak.py
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from omegaconf import OmegaConf

from gtpo.launch.gpu_peak import GIB, kv_cache, largest_share, passes, peak_lines, peak_problems
from gtpo.launch.runs import presets
from gtpo.launch.state_memory import KNOWN_MODELS, lora_parameters
from tests.support.configs import compose
from tests.support.e2e import REPO_ROOT
from tests.support.launch import dry_run_env

LORA_3B = ["method=gtpo", "model=qwen2.5_3b", "adapter=lora", "actor_rollout_ref.model.path=/m/Qwen2.5-3B"]
LORA_7B = ["method=gtpo", "model=qwen2.5_7b", "adapter=lora", "actor_rollout_ref.model.path=/m/Qwen2.5-7B"]


def resolved(overrides):
    cfg = compose(overrides)
    OmegaConf.resolve(cfg)
    return cfg


def by_name(cfg, model="Qwen2.5-3B"):
    from gtpo.launch.memory_estimate import vocabulary

    return {p.name: p for p in passes(cfg, KNOWN_MODELS[model], vocabulary(cfg)[0])}


def test_the_3b_lora_old_log_prob_pass_stages_the_whole_base():
    """verl moves the whole fp32 base to the GPU for every pass (BaseEngineCtx -> load_fsdp_model_to_gpu): the
    review's terms, 12.3 GB base + adapters, logits and an entropy chunk at the 12,288-token budget, AdamW on the GPU,
    exceed a 24 GiB card once the contexts are counted; the preset's 6,144-token budgets and optimizer offload fit."""
    arch = KNOWN_MODELS["Qwen2.5-3B"]
    adapters = lora_parameters(arch, 128, "all-linear")
    before = resolved([*LORA_3B, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=12288",
                       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"])  # fmt: skip
    old = dict(by_name(before)["old-log-prob"].parts)
    assert old["base + adapters staged"] == pytest.approx((arch.parameters + adapters) * 4 / GIB)
    assert old["AdamW"] == pytest.approx(adapters * 8 / GIB)
    assert old["logits"] == pytest.approx(12288 * 151936 * 2 / GIB)
    assert old["entropy chunk"] == pytest.approx(2048 * 151936 * 4 * 3 / GIB)
    assert by_name(before)["old-log-prob"].total(24) > 24 - 0.5
    problems = peak_problems(before)
    assert any(p.startswith("the old-log-prob pass needs about 24.") and "24 GiB GPU" in p for p in problems), problems
    preset = resolved(LORA_3B)
    assert peak_problems(preset) == []
    assert all(p.total(24) <= 23.5 for p in by_name(preset).values())


def test_the_3b_lora_preset_targets_24_and_48_gib_and_fits_both():
    cfg = resolved(LORA_3B)
    assert tuple(cfg.algorithm.hardware.gpu_memory_gib) == (24, 48)
    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    assert fsdp.param_offload and fsdp.optimizer_offload
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 6144
    lines = peak_lines(cfg)
    assert lines[0].startswith(
        "GPU peak per pass on the GPUs this run is sized for (algorithm.hardware.gpu_memory_gib=[24, 48]"
    )
    assert sum("24 GiB GPU" in line and ": fits" in line for line in lines) == 4
    assert sum("48 GiB GPU" in line and ": fits" in line for line in lines) == 4


def test_the_7b_lora_share_comes_from_the_generation_pass():
    """During generation the actor holds only the adapters' AdamW: the largest share that fits is ~0.95; the preset
    gives 0.8, about 48 GiB of KV cache instead of 0.45's 20."""
    cfg = resolved(LORA_7B)
    generation = by_name(cfg, "Qwen2.5-7B")["generation"]
    adapters = lora_parameters(KNOWN_MODELS["Qwen2.5-7B"], 128, "all-linear")
    assert dict(generation.parts) == {"base + adapters": 0.0, "AdamW": pytest.approx(adapters * 8 / GIB),
                                      "actor context": 1.0}  # fmt: skip
    assert cfg.actor_rollout_ref.rollout.gpu_memory_utilization == 0.8 <= largest_share(generation, 80) - 0.1
    kv, sequences = kv_cache(cfg, KNOWN_MODELS["Qwen2.5-7B"], 80)
    assert 45 < kv < 50 and sequences > 130
    kv_before, _ = kv_cache(resolved([*LORA_7B, "actor_rollout_ref.rollout.gpu_memory_utilization=0.45"]),
                            KNOWN_MODELS["Qwen2.5-7B"], 80)  # fmt: skip
    assert kv_before < 20


@pytest.mark.parametrize("model", presets("model"))
def test_every_model_preset_fits_the_gpus_it_is_sized_for(model):
    hub = OmegaConf.select(compose([f"model={model}"]), "actor_rollout_ref.model.path")
    overrides = ["method=gtpo", f"model={model}", f"actor_rollout_ref.model.path=/m/{hub.rpartition('/')[2]}"]
    overrides += ["scale=smoke"] if model == "qwen2.5_0.5b" else []
    cfg = resolved(overrides)
    assert peak_problems(cfg) == []
    assert not any("not estimated" in line for line in peak_lines(cfg))


def test_a_model_too_large_for_its_share_is_refused_by_name():
    """The 3B LoRA preset pointed at a 32B folder: vLLM's share holds not even its weights (the dry run used to print
    "0 sequences", then OK)."""
    cfg = resolved([*LORA_3B[:3], "actor_rollout_ref.model.path=/m/Qwen2.5-32B"])
    problems = peak_problems(cfg)
    assert any("leaves vLLM" in p and "not one 6,144-token sequence" in p and "Qwen2.5-32B" in p for p in problems)


def test_the_cpu_backend_is_not_sized_for_a_gpu():
    assert peak_lines(resolved(["backend=cpu_tiny"]))[0].startswith("GPU peak per pass: not estimated (the CPU backend")


def test_separate_async_trainer_gpus_hold_no_vllm():
    cfg = resolved(["method=gtpo", "model=qwen2.5_7b", "trainer=separate_async", "actor_rollout_ref.rollout.nnodes=1",
                    "actor_rollout_ref.model.path=/m/Qwen2.5-7B"])  # fmt: skip
    found = by_name(cfg, "Qwen2.5-7B")
    assert set(found) == {"old-log-prob", "training", "rollout pool generation"}
    assert "vLLM asleep" not in dict(found["training"].parts)
    assert found["rollout pool generation"].total(80) == pytest.approx(0.85 * 80)


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("peak_dry")
    env = dry_run_env(tmp)
    scripts = ["run_gtpo_qwen2.5_7b.sh", "run_gtpo_qwen2.5_3b_lora.sh", "run_gtpo_qwen3_8b_base.sh",
               "run_smoke_qwen2.5_0.5b.sh"]  # fmt: skip

    def run(script):
        cmd = ["bash", str(REPO_ROOT / "scripts" / script)]
        result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        return script, result.stdout

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, scripts))


@pytest.mark.parametrize(
    "script,cards",
    [("run_gtpo_qwen2.5_7b.sh", [80]), ("run_gtpo_qwen2.5_3b_lora.sh", [24, 48]),
     ("run_gtpo_qwen3_8b_base.sh", [80]), ("run_smoke_qwen2.5_0.5b.sh", [24, 80])],
)  # fmt: skip
def test_every_launcher_prints_the_peak_on_the_gpus_its_preset_targets(dry_runs, script, cards):
    out = dry_runs[script]
    printed = sorted({float(c) for c in re.findall(r"\[dry run\]   (\d+) GiB GPU, ", out)})
    assert printed == cards, out[-3000:]
    assert "on a 24 GB GPU" not in out  # the old line about a card the preset never uses
    for name in ("generation", "weight sync", "old-log-prob", "training"):
        assert re.search(rf"GiB GPU, {name}: .* GiB: fits", out), name
    assert "DOES NOT FIT" not in out


def test_the_lora_pages_state_the_figures_of_the_estimate():
    """README and docs/cluster.md name the one-GPU cards of the LoRA pieces, and their peak and share figures."""
    readme, cluster = (REPO_ROOT / "README.md").read_text(), (REPO_ROOT / "docs" / "cluster.md").read_text()
    for text in (readme, cluster):
        assert "24 or 48 GB" in text and "24–48 GB" not in text
    assert "gpu_memory_utilization` 0.8" in cluster or "gpu_memory_utilization=0.8" in cluster
    peaks = [max(p.total(24) for p in by_name(resolved(LORA_3B)).values())]
    assert f"{peaks[0]:.0f} GiB" in cluster, peaks
