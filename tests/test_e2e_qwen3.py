"""The Qwen3 architecture through verl 0.9.1's real PPO trainer and vLLM on CPU: GTPO for two steps.

    GTPO_SLOW_TESTS=1 .venv/bin/python -m pytest -q -m e2e tests/test_e2e_qwen3.py

The slow tier (tests/conftest.py). The model is the tiny random ``Qwen3ForCausalLM`` of
:func:`gtpo.cpu.tiny_assets.build_tiny_qwen3_assets` (q/k norms, 4 heads x 32 against hidden 64, untied
embeddings), built here only: the default tier never builds it. Tokenizer, data and the coin reward are those of
tests/test_e2e_trainer.py, whose Qwen2 runs this one mirrors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.e2e import assert_ran, base_overrides, run_recipe

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="session")
def qwen3_assets():
    from gtpo.cpu.tiny_assets import build_tiny_qwen3_assets

    return build_tiny_qwen3_assets()


def test_qwen3_gtpo_two_steps(ray_cluster, qwen3_assets, tmp_path):
    """A Qwen3 model trains two GTPO steps: vLLM generates with it, the FSDP actor computes its entropies and
    updates it, and vLLM's token probabilities agree with the actor's at both steps: vLLM computes the same
    architecture (q/k norms, 128-wide attention on a 64-wide residual, separate lm_head), and the weight sync
    after step 1 put every updated tensor where vLLM reads it."""
    config = json.loads((Path(qwen3_assets.model_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"] is False
    overrides = base_overrides(qwen3_assets) + ["method=gtpo", "algorithm.filter_groups.enable=false"]
    result = run_recipe(ray_cluster, tmp_path, overrides)
    assert_ran(result, steps=2)
    # verl's actor built the Qwen3 class: 2 x 151,936 x 64 embeddings + 2 layers = 19,546,560 parameters.
    assert "Qwen3ForCausalLM contains 19.55M parameters" in result.log
    for entry in result.metrics:
        data = entry["data"]
        # Entropy reached the estimator: a random model's is near ln(151,936) = 11.93, far from 0.
        assert data["gtpo/entropy_correct_mean"] > 1.0 or data["gtpo/entropy_incorrect_mean"] > 1.0
        # vLLM's sampled-token probabilities against the actor's recomputed ones (1.0 and 0.0018 measured): a
        # layer computed or loaded differently would change which tokens the random model favours, and decorrelate
        # them.
        assert data["training/rollout_actor_probs_pearson_corr"] > 0.99, (entry["step"], data)
        assert abs(data["rollout_corr/log_ppl_diff"]) < 0.01, (entry["step"], data)
        assert data["actor/grad_norm"] > 0.0
