"""The Qwen3 presets (configs/model/qwen3_*.yaml) through their launchers, scripts/run_gtpo_<preset>.sh: the dry run
each passes and what it resolves to.

    .venv/bin/python -m pytest -q tests/test_qwen3_presets.py
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from gtpo.launch.runs import presets, read_preset
from tests.support.e2e import REPO_ROOT
from tests.support.launch import dry_run_env, resolved_config

# What each Qwen3 preset's architecture and chat template give (docs/knobs.md, "Qwen3").
LAUNCHERS = {
    "qwen3_8b_base": dict(name="Qwen3-8B-Base", nnodes=1, tp=1, thinking=None, params="8.19"),
    "qwen3_32b": dict(name="Qwen3-32B", nnodes=4, tp=4, thinking=False, params="32.76"),
}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("qwen3_dry")
    env = dry_run_env(tmp)

    def run(preset):
        cmd = ["bash", str(REPO_ROOT / "scripts" / f"run_gtpo_{preset}.sh")]
        return preset, subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, LAUNCHERS))


def test_every_qwen3_preset_is_published_and_stated_here():
    qwen3 = [m for m in presets("model") if m.startswith("qwen3")]
    assert sorted(LAUNCHERS) == qwen3 and all((REPO_ROOT / "scripts" / f"run_gtpo_{m}.sh").is_file() for m in qwen3)


@pytest.mark.parametrize("preset", LAUNCHERS)
def test_the_qwen3_launcher_dry_run(dry_runs, preset):
    want, result = LAUNCHERS[preset], dry_runs[preset]
    trainer = read_preset("model", preset)["trainer"]  # the counts come from the preset
    assert (want["nnodes"], 8) == (trainer["nnodes"], trainer["n_gpus_per_node"])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "[dry run] OK" in result.stdout
    cfg = resolved_config(result.stdout)
    arr = cfg["actor_rollout_ref"]
    assert arr["model"]["path"].endswith(f"/models/{want['name']}")
    assert (cfg["trainer"]["nnodes"], cfg["trainer"]["n_gpus_per_node"]) == (want["nnodes"], 8)
    assert arr["rollout"]["tensor_model_parallel_size"] == want["tp"]
    assert cfg["data"].get("apply_chat_template_kwargs", {}).get("enable_thinking") == want["thinking"]
    assert f"actor: {want['params']} B parameters x 16 B" in result.stdout  # the model-sized memory line
