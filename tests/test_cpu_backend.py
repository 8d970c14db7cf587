"""CPU backend pieces without Ray: the tiny offline fixture, the cpu platform and the environment helper (vLLM's
side of the backend: tests/test_vllm_patches.py).

Run: ``.venv/bin/pytest -q tests/test_cpu_backend.py``  (builds the fixture into ``$GTPO_CACHE_DIR`` or
``~/.cache/gtpo/tiny`` on first use, ~7 s; afterwards the file runs in ~15 s).
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path

import pytest
import torch

from gtpo.cpu.tiny_assets import (
    FIRST_SPECIAL_ID,
    NON_SPECIAL_ADDED_TOKENS,
    SPECIAL_TOKENS,
    build_tiny_assets,
    load_tiktoken_ranks,
    recipe_key,
)

# Qwen2's pre-tokenizer regex (the tiktoken pattern of the Qwen models)
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
EOS, PAD = 151645, 151643


# ----------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def assets():
    return build_tiny_assets()


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets.tokenizer_dir)


@pytest.fixture(scope="module")
def model(assets):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(assets.model_dir, attn_implementation="sdpa")


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


@pytest.mark.parametrize(
    "text, ids",
    [
        ("hello", [14990]),
        (" world", [1879]),
        ("😊", [144236]),
        (" hello sir. How are you Edward?", [23811, 27048, 13, 2585, 525, 498, 21891, 30]),
        ("<|im_start|>hello<|im_end|>", [151644, 14990, 151645]),
        ("\n", [198]),
    ],
)
def test_tokenizer_reference_ids(tokenizer, text, ids):
    assert tokenizer.encode(text) == ids


def test_tokenizer_special_tokens_and_template(tokenizer):
    assert len(tokenizer) == 151665
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == EOS
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == PAD
    assert tokenizer.bos_token is None
    for i, tok in enumerate(SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(tok) == FIRST_SPECIAL_ID + i
    # special tokens vanish with skip_special_tokens, <tool_call> (non-special) stays
    assert tokenizer.decode([PAD, 14990, 151657, EOS], skip_special_tokens=True) == "hello<tool_call>"
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"},
    ]
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    role_ids = [ids[i + 1] for i, t in enumerate(ids) if t == 151644]
    assert role_ids == [8948, 872, 77091]
    text = tokenizer.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_matches_tiktoken(tokenizer, shared_data):
    tiktoken = pytest.importorskip("tiktoken")
    enc = tiktoken.Encoding(name="qwen", pat_str=QWEN_PATTERN, mergeable_ranks=load_tiktoken_ranks(), special_tokens={})
    texts = []
    for name in ("gsm8k_test.jsonl", "math500.jsonl"):
        with open(shared_data / name, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i >= 150:
                    break
                rec = json.loads(line)
                texts += [rec["problem"], rec.get("solution", "")]
    texts += ["  leading spaces\n\n\ttabs", "数学题：1+1=？", "emoji 😊👍🏽 mix", "x\r\ny  \n"]
    # HF normalises to NFC, tiktoken does not: compare on NFC text.
    texts = [unicodedata.normalize("NFC", t) for t in texts if t]
    assert len(texts) >= 300
    mismatches = [t for t in texts if tokenizer.encode(t) != enc.encode_ordinary(t)]
    assert mismatches == []


# ----------------------------------------------------------------------------------------------------------------
# fixture files


def test_tiny_assets_idempotent_and_complete(assets, tmp_path_factory):
    again = build_tiny_assets()
    assert again == assets
    assert Path(assets.model_dir).name == "model" and Path(assets.tokenizer_dir).name == "tokenizer"
    assert Path(assets.model_dir).parent.name.endswith(recipe_key())
    # tokenizer in its own folder, weights as safetensors
    assert not (Path(assets.model_dir) / "tokenizer.json").exists()
    assert (Path(assets.model_dir) / "model.safetensors").is_file()


def test_tiny_model_shape(model):
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (151936, 64, 2)
    # head size 32: vLLM's CPU attention supports 32, 64, 80, ... (not 16); one KV head per two query heads (GQA)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 1)
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert cfg.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32


def test_tiny_parquet(assets, tokenizer):
    import pandas as pd

    train, val = pd.read_parquet(assets.train_parquet), pd.read_parquet(assets.val_parquet)
    assert (len(train), len(val)) == (16, 4)
    for df, split in ((train, "train"), (val, "test")):
        assert set(df.columns) >= {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        for _, row in df.iterrows():
            assert list(row.prompt)[0]["role"] == "user"
            assert row.reward_model["ground_truth"] == row.extra_info["answer"]
            assert row.extra_info["split"] == split
            n = len(tokenizer.apply_chat_template(list(row.prompt), add_generation_prompt=True, tokenize=False))
            assert n > 0
    prompt_lens = [
        len(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True, return_dict=True)
            ["input_ids"])
        for p in pd.concat([train, val]).prompt
    ]  # fmt: skip
    # the cpu_tiny preset uses max_prompt_length 128
    assert max(prompt_lens) <= 128
    assert set(train.extra_info.map(lambda e: e["id"])).isdisjoint(val.extra_info.map(lambda e: e["id"]))


# ----------------------------------------------------------------------------------------------------------------
# platform


def test_cpu_platform():
    from verl.plugin.platform import PlatformRegistry

    from gtpo.cpu.platform import CPU_DEVICE_MODULE, PlatformCPU

    assert PlatformRegistry.get("cpu") is PlatformCPU
    p = PlatformCPU()
    assert p.device_name == "cpu" and p.communication_backend_name() == "gloo"
    assert p.ray_resource_name() == "GPU" and p.ray_resource_options(1) == {"num_gpus": 1}
    assert p.current_device() == "cpu" and torch.zeros(1).to(p.current_device()).device.type == "cpu"
    assert not p.is_ipc_supported() and p.cudart() is None and p.is_available()
    assert not p.is_platform_available(use_smi_check=True)
    with p.nvtx_range("x"):
        pass
    m = p.device_module
    assert m is CPU_DEVICE_MODULE
    assert m.memory_allocated() == 0 and m.max_memory_reserved() == 0
    assert m.mem_get_info() == (8 << 30, 16 << 30)
    assert m.get_device_name() == "CPU" and m.current_device() == "cpu"
    for fn in (m.empty_cache, m.reset_peak_memory_stats, m.ipc_collect, m.synchronize):
        assert fn() is None
    m.set_device(0)
    m.manual_seed(1)
    m.manual_seed_all(1)


# Imports the platform module in a fresh interpreter and prints the backends verl's process-group helper asks torch
# for: without a backend, and with one given.
GLOO_PROBE = """
import torch
import verl.utils.distributed as dist_utils

import gtpo.cpu.platform

calls = []
torch.distributed.is_initialized = lambda: False
torch.distributed.init_process_group = lambda **kw: calls.append(kw["backend"])
dist_utils.initialize_global_process_group_ray(timeout_second=None)
dist_utils.initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
print(calls)
"""


@pytest.mark.parametrize(
    "platform, backends",
    [
        ("cpu", ["gloo", "cpu:gloo"]),  # the CPU backend: plain gloo, not verl's invalid "cpu:gloo,cpu:gloo"
        (None, ["cpu:gloo,cuda:nccl", "cpu:gloo"]),  # a GPU run that imports the module: verl's default untouched
        ("nvidia", ["cpu:gloo,cuda:nccl", "cpu:gloo"]),
    ],
)
def test_gloo_default_backend_only_under_verl_platform_cpu(platform, backends):
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    env.update(PYTHONPATH=repo, PYTHONWARNINGS="ignore", **({"VERL_PLATFORM": platform} if platform else {}))
    proc = subprocess.run([sys.executable, "-c", GLOO_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == repr(backends)


@pytest.mark.parametrize(
    "device, env, runtime_env, found",
    [
        ("cuda", {"VERL_PLATFORM": "cpu"}, {}, "VERL_PLATFORM=cpu (the environment)"),
        (
            "cuda",
            {"VERL_USE_EXTERNAL_MODULES": "gtpo.cpu.platform,gtpo.verl_plugin.register"},
            {},
            "VERL_USE_EXTERNAL_MODULES with gtpo.cpu.platform (the environment)",
        ),
        (
            "npu",
            {},
            {"VERL_USE_EXTERNAL_MODULES": "gtpo.cpu.vllm_patches", "VERL_PLATFORM": " CPU"},
            "VERL_PLATFORM= CPU (ray_kwargs.ray_init.runtime_env.env_vars); VERL_USE_EXTERNAL_MODULES with "
            "gtpo.cpu.vllm_patches (ray_kwargs.ray_init.runtime_env.env_vars)",
        ),
        (
            "cuda",
            {"VERL_USE_EXTERNAL_MODULES": "gtpo.cpuish,gtpo.verl_plugin.register", "VERL_PLATFORM": "nvidia"},
            {},
            None,
        ),
        ("cpu", {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "gtpo.cpu.platform"}, {}, None),
    ],
)
def test_cpu_backend_is_refused_on_a_gpu_run(device, env, runtime_env, found):
    from omegaconf import OmegaConf

    from gtpo.launch.checks import check_cpu_backend

    config = OmegaConf.create(
        {"trainer": {"device": device}, "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": runtime_env}}}}
    )
    if found is None:
        check_cpu_backend(config, env)
        return
    with pytest.raises(ValueError) as info:
        check_cpu_backend(config, env)
    assert str(info.value).startswith(f"trainer.device={device} but {found}: the CPU test backend")
    assert "backend=cpu_tiny" in str(info.value)


def test_prepare_config_refuses_the_cpu_backend_before_ray(monkeypatch):
    """The recipe's entry point stops a GPU run that inherited the CPU backend's variables before anything starts."""
    from gtpo.launch.dry_run import compose_config
    from recipe.gtpo.main_gtpo import prepare_config

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    cfg = compose_config(["method=gtpo", "model=qwen2.5_7b"])
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "gtpo.cpu.platform")
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    with pytest.raises(
        ValueError, match=r"trainer\.device=cuda but VERL_USE_EXTERNAL_MODULES with gtpo\.cpu\.platform"
    ):
        prepare_config(cfg, dry_run=True)


# ----------------------------------------------------------------------------------------------------------------
# environment


def test_env_helper():
    from gtpo.cpu import env

    e = env(extra_modules=["gtpo.verl_plugin.register"], base={"VERL_USE_EXTERNAL_MODULES": "x.y,gtpo.cpu.platform"})
    assert e["VERL_USE_EXTERNAL_MODULES"] == "gtpo.cpu.platform,gtpo.verl_plugin.register,x.y"
    assert (e["VERL_PLATFORM"], e["VERL_ENGINE_DEVICE"], e["VERL_ENGINE_VENDOR"]) == ("cpu", "cuda", "nvidia")
    assert e["HYDRA_FULL_ERROR"] == "1" and e["WANDB_MODE"] == "disabled" and e["TOKENIZERS_PARALLELISM"] == "false"
    assert str(Path(__file__).resolve().parents[1]) in e["PYTHONPATH"].split(":")
