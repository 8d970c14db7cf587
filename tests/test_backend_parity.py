"""The CPU backend computes what the presets compute: every knob a model or scale preset sets is either what CI runs
(``backend=cpu_tiny`` alone, the configuration of every default-tier trainer run and of the demo) or on a short list
of CPU-only differences, each with its reason.

    .venv/bin/python -m pytest -q tests/test_backend_parity.py

A new knob in ``configs/model/*.yaml`` or ``configs/scale/**/*.yaml`` whose value the CPU backend does not share fails
here until the backend runs it or :data:`CPU_ONLY` names it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.configs import REPO_ROOT, compose

# Preset keys (dotted prefixes) the CPU backend may leave at another value, and why. Everything else a preset sets
# (remove padding, token-budget micro-batches, chunked entropy and its eager compile setting, activation
# checkpointing, FSDP2, weight decay, truncation, the vLLM rollout) the backend runs as the presets do.
CPU_ONLY = {
    "actor_rollout_ref.model.path": "the tiny offline model",
    "actor_rollout_ref.actor.fsdp_config.param_offload": (
        "the 32B preset's offload moves states to CPU memory, where a CPU run's already are; its code path runs in "
        "tests/test_path_equivalence.py (offload)"
    ),
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "as param_offload",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": (
        "scale=dapo's Ulysses 4 / 8 needs several ranks per sequence: tests/test_path_equivalence.py (ulysses2) and "
        "the slow tier's Ulysses run"
    ),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "one vLLM CPU process per replica (uni executor)",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "vLLM's CPU KV cache is sized in bytes (kv_cache_memory_bytes)",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "size: the tiny runs' sequences",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "token budget scaled to the tiny runs",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "token budget scaled to the tiny runs",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "token budget scaled to the tiny runs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "batch size",
    "actor_rollout_ref.rollout.n": "batch size",
    "data.train_batch_size": "batch size",
    "data.max_prompt_length": "length",
    "data.max_response_length": "length",
    "actor_rollout_ref.rollout.max_model_len": "length (the tiny models' own position limit)",
    "reward.reward_kwargs.overlong_buffer_cfg.len": "length (DAPO's overlong buffer; set where a method uses it)",
    "data.val_max_samples": "validation size",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "run length (a warm-up over a long run's first steps)",
    "trainer.total_training_steps": "run length",
    "trainer.save_freq": "cadence: each test run sets its own",
    "trainer.test_freq": "cadence: each test run sets its own",
    "trainer.max_actor_ckpt_to_keep": "retention: each resume test sets its own",
    "trainer.logger": "trackers: no W&B account on a test machine; each run that reads metrics adds the file logger",
    "trainer.nnodes": "GPU count",
    "trainer.n_gpus_per_node": "GPU count",
    "data.apply_chat_template_kwargs": (
        "Qwen3-32B's thinking switch: the tiny tokenizer's template has no thinking mode; the reward on responses "
        "that think: tests/test_reward_think.py"
    ),
    "actor_rollout_ref.model.lora_rank": (
        "LoRA (adapter=lora) runs in the slow tier's tests/test_e2e_lora.py and `python -m gtpo.cpu.demo "
        "--lora-rank`, at ranks the tiny model has room for"
    ),
    "actor_rollout_ref.model.lora_alpha": "as lora_rank",
    "actor_rollout_ref.actor.optim.lr": "learning rate: the adapters' (adapter=lora); the LoRA runs set their own",
    "actor_rollout_ref.rollout.layered_summon": "LoRA's layer-by-layer adapter gather: as lora_rank",
    "actor_rollout_ref.actor.checkpoint.save_lora_only": "LoRA's adapters-only checkpoints: as lora_rank",
    "algorithm.hardware.gpu_memory_gib": (
        "the GPUs a preset is sized for, read only by the dry run's per-pass GPU peak; the CPU backend has no GPU"
    ),
    "actor_rollout_ref.rollout.load_format": (
        "vLLM's start-up weights: the CPU backend starts vLLM on dummy weights and verl's first sync sends the base "
        "(tests/test_e2e_lora.py checks it loads once); the LoRA preset has vLLM read them from the model folder"
    ),
}


def preset_files() -> list[Path]:
    configs = REPO_ROOT / "configs"
    pieces = sorted((configs / "scale").rglob("*.yaml")) + sorted((configs / "adapter").rglob("*.yaml"))
    return sorted((configs / "model").glob("*.yaml")) + pieces


def selection(path: Path) -> list[str]:
    """The config-group choices that load ``path`` (a scale or adapter piece needs its own choice and its model or
    method)."""
    rel = path.relative_to(REPO_ROOT / "configs")
    if rel.parts[0] == "model":
        return [f"model={path.stem}"]
    if len(rel.parts) == 2:
        return [f"{rel.parts[0]}={path.stem}"]
    choice, rest = path.stem.split("_", 1)
    return [f"{rel.parts[0]}={choice}", f"{rel.parts[1]}={rest}"]


def set_keys(node, prefix: str = "") -> list[str]:
    """Dotted leaf keys a preset file sets."""
    if isinstance(node, dict):
        return [k for key, value in node.items() if key != "defaults" for k in set_keys(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")]


def _value(cfg, key: str):
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key, default="<not set>")
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def unnamed_differences(preset_values: dict[str, object], backend, allowed: dict[str, str]) -> list[str]:
    """``key: preset value != backend value`` for every preset key the backend runs differently without a reason."""

    def named(key: str) -> bool:
        return any(key == p or key.startswith(p + ".") for p in allowed)

    return [
        f"{key}: preset {value!r}, CPU backend {_value(backend, key)!r}"
        for key, value in preset_values.items()
        if value != _value(backend, key) and not named(key)
    ]


@pytest.fixture(scope="module")
def backend():
    return compose(["backend=cpu_tiny"])


@pytest.fixture(scope="module")
def preset_values() -> dict[str, dict[str, object]]:
    """``{preset file: {key: resolved value}}`` for every key each preset file sets."""
    out = {}
    for path in preset_files():
        cfg = compose(selection(path))
        out[str(path.relative_to(REPO_ROOT))] = {k: _value(cfg, k) for k in set_keys(yaml.safe_load(path.read_text()))}
    return out


def test_every_preset_knob_runs_on_the_cpu_backend_or_is_named(backend, preset_values):
    assert len(preset_values) >= 10 and sum(len(v) for v in preset_values.values()) > 100
    problems = [
        f"{name}: {p}" for name, values in preset_values.items() for p in unnamed_differences(values, backend, CPU_ONLY)
    ]
    assert not problems, "the CPU backend computes differently from a preset:\n" + "\n".join(problems)


def test_the_backend_runs_the_presets_code_path(backend, preset_values):
    """The knobs that change how verl computes entropy, log-probs and the loss are on in every CI run."""
    path_knobs = {
        "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking": True,
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
        "actor_rollout_ref.actor.strategy": "fsdp2",
    }
    for key, value in path_knobs.items():
        assert _value(backend, key) == value, key
        assert all(values[key] == value for name, values in preset_values.items() if name.startswith("configs/model"))
    # the old-log-prob and reference passes follow the actor's token budgets
    assert _value(backend, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz") is True
    assert _value(backend, "actor_rollout_ref.ref.log_prob_use_dynamic_bsz") is True
    # chunking really happens on the tiny runs: a chunk is smaller than one full sequence
    longest = _value(backend, "data.max_prompt_length") + _value(backend, "data.max_response_length")
    assert _value(backend, "actor_rollout_ref.actor.entropy_from_logits_chunk_size") < longest


def test_every_named_difference_is_one_a_preset_has(backend, preset_values):
    """No stale entry: each name on the list differs in at least one preset."""
    differing = {
        key for values in preset_values.values() for key, value in values.items() if value != _value(backend, key)
    }
    stale = [p for p in CPU_ONLY if not any(k == p or k.startswith(p + ".") for k in differing)]
    assert not stale, f"CPU_ONLY names keys no preset sets differently: {stale}"


def test_a_new_preset_knob_fails_until_the_backend_runs_it_or_names_it(backend, preset_values, tmp_path):
    """A planted knob in a copy of the 7B preset: reported with both values; named, it passes."""
    path = REPO_ROOT / "configs" / "model" / "qwen2.5_7b.yaml"
    planted = yaml.safe_load(path.read_text())
    planted["actor_rollout_ref"]["actor"]["entropy_checkpointing"] = True
    planted["actor_rollout_ref"]["actor"]["fsdp_config"]["param_offload"] = True
    values = dict(preset_values["configs/model/qwen2.5_7b.yaml"])
    for key in set_keys(planted):
        values.setdefault(key, True)
    values["actor_rollout_ref.actor.fsdp_config.param_offload"] = True
    problems = unnamed_differences(values, backend, CPU_ONLY)
    assert problems == ["actor_rollout_ref.actor.entropy_checkpointing: preset True, CPU backend False"]
    assert not unnamed_differences(values, backend, {**CPU_ONLY, "actor_rollout_ref.actor.entropy_checkpointing": "x"})


# ----------------------------------------------------------------------------------------------------------------
# Ulysses and the attention implementation


def test_ulysses_is_refused_with_an_attention_that_does_not_gather_the_sequence():
    from gtpo.launch.checks import validate_recipe_config

    validate_recipe_config(compose(["model=qwen2.5_7b", "scale=dapo"]))  # Ulysses 4, verl's flash_attention_2
    sdpa = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"
    with pytest.raises(ValueError, match=r"ulysses_sequence_parallel_size=4 with .*attn_implementation=sdpa"):
        validate_recipe_config(compose(["model=qwen2.5_7b", "scale=dapo", sdpa]))
    two = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    validate_recipe_config(compose(["backend=cpu_tiny", *two]))  # the CPU backend's gtpo_cpu_sdpa
    with pytest.raises(ValueError, match=r"each rank would attend within its own shard"):
        validate_recipe_config(compose(["backend=cpu_tiny", *two, sdpa[1:]]))
    # the engine's own Ulysses key counts too (verl reads it when the actor's is 1)
    engine = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"]
    with pytest.raises(ValueError, match=r"fsdp_config.ulysses_sequence_parallel_size=2 with .*=sdpa"):
        validate_recipe_config(compose(["backend=cpu_tiny", *engine, sdpa[1:]]))


def test_the_reference_models_ulysses_is_checked_like_the_actors():
    """The reference model's own Ulysses size under an attention that does not gather the sequence: its log-probs
    would be computed shard-locally, wrong, without an error."""
    from gtpo.launch.checks import check_sequence_parallel_attention

    ref = ["backend=cpu_tiny", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.use_kl_loss=true",
           "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"]  # fmt: skip
    check_sequence_parallel_attention(compose(ref))  # the CPU backend's gtpo_cpu_sdpa gathers it
    sdpa = "actor_rollout_ref.model.override_config.attn_implementation=sdpa"
    with pytest.raises(ValueError, match=r"ref.ulysses_sequence_parallel_size=2 with .*attn_implementation=sdpa"):
        check_sequence_parallel_attention(compose([*ref, sdpa]))


def test_flash_attention_3_is_accepted_with_ulysses():
    from gtpo.launch.checks import check_sequence_parallel_attention

    fa3 = "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_3"
    check_sequence_parallel_attention(compose(["model=qwen2.5_7b", "scale=dapo", fa3]))  # Ulysses 4


def test_the_cpu_ulysses_attention_with_one_kv_head_equals_sdpa_over_the_packed_row(tmp_path):
    """Two gloo ranks, Ulysses 2, query of 2 heads and key/value of ONE KV head (repeated up to the SP size before
    the all-to-all, as verl's wrapper does), two packed sequences: each rank's output is its shard of one process's
    SDPA over the whole row with the packed causal mask."""
    import torch
    import torch.multiprocessing as mp
    from transformers.integrations.sdpa_attention import repeat_kv

    from gtpo.cpu.ulysses_attention import packed_causal_mask
    from tests.support.ulysses import packed_row, rank_main

    mp.spawn(rank_main, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    query, key, value, positions = packed_row()
    mask = packed_causal_mask(positions)
    whole = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, 2), repeat_kv(value, 2), mask)
    whole = whole.transpose(1, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got, whole[:, 3 * rank : 3 * rank + 3], rtol=1e-6, atol=1e-6)


def test_packed_causal_mask_stops_at_each_sequence_start():
    import torch

    from gtpo.cpu.ulysses_attention import packed_causal_mask

    mask = packed_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 6, 6) and torch.equal(mask[0, 0], expected)


def test_the_cpu_attention_is_transformers_sdpa_without_ulysses():
    """At sequence-parallel size 1 ``gtpo_cpu_sdpa`` returns exactly transformers' SDPA attention."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from gtpo.cpu.ulysses_attention import ulysses_sdpa_attention

    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, h, 5, 8, generator=gen) for h in (2, 1, 1))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    mine, _ = ulysses_sdpa_attention(module, query, key, value, None, scaling=0.3, position_ids=torch.arange(5)[None])
    theirs, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3, position_ids=torch.arange(5)[None])
    assert mine.shape == (1, 5, 2, 8) and torch.equal(mine, theirs)
