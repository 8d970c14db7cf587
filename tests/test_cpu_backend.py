"""CPU backend pieces without Ray: the tiny offline fixture, the cpu platform, the hf rollout sampler/server and
the environment helper.

Run: ``.venv/bin/pytest -q tests/test_cpu_backend.py``  (builds the fixture into ``$GTPO_CACHE_DIR`` or
``~/.cache/gtpo/tiny`` on first use, ~7 s; afterwards the file runs in ~15 s).
"""

from __future__ import annotations

import asyncio
import json
import unicodedata
from pathlib import Path

import pytest
import torch

from gtpo.cpu.hf_rollout import GenRequest, HFRolloutServer, HFSampler, load_causal_lm
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
    return load_causal_lm(assets.model_dir)


@pytest.fixture()
def sampler(model):
    return HFSampler(model, eos_token_ids=[EOS, PAD], max_model_len=256, seed=0, pad_token_id=PAD)


def _server(sampler: HFSampler, prompt_length: int = 32, response_length: int = 8) -> HFRolloutServer:
    return HFRolloutServer(config={"prompt_length": prompt_length, "response_length": response_length}, sampler=sampler)


def _forward_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of an unbatched, unpadded, cache-free forward pass."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


PROMPTS = [[14990, 1879, 13], [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198], [23811, 27048], [30] * 6]


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
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
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


def test_gloo_default_backend(monkeypatch):
    import verl.utils.distributed as dist_utils

    import gtpo.cpu.platform  # noqa: F401  (installs the wrapper)

    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kw: calls.append(kw))
    dist_utils.initialize_global_process_group_ray(timeout_second=None)
    dist_utils.initialize_global_process_group_ray(timeout_second=None, backend="cpu:gloo")
    assert [c["backend"] for c in calls] == ["gloo", "cpu:gloo"]


# ----------------------------------------------------------------------------------------------------------------
# hf rollout: sampling core


def test_logprobs_match_forward_pass(sampler, model):
    temperature = 0.7
    reqs = [GenRequest(prompt_ids=p, max_tokens=6, temperature=temperature, logprobs=True) for p in PROMPTS]
    results = sampler.generate(reqs)
    vocab = model.config.vocab_size
    for req, res in zip(reqs, results, strict=True):
        assert len(res.token_ids) == 6 and res.finish_reason == "length"
        assert all(0 <= t < vocab for t in res.token_ids)
        logits = _forward_logits(model, req.prompt_ids + res.token_ids)
        ref = (logits / temperature).log_softmax(-1)[len(req.prompt_ids) - 1 : -1]
        ref = ref.gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.log_probs), ref, atol=1e-4, rtol=0)


def test_raw_logprobs_mode(model):
    s = HFSampler(model, [EOS], 256, logprobs_mode="raw_logprobs", pad_token_id=PAD)
    res = s.generate([GenRequest(prompt_ids=PROMPTS[0], max_tokens=4, temperature=0.5)])[0]
    ref = _forward_logits(model, PROMPTS[0] + res.token_ids).log_softmax(-1)[len(PROMPTS[0]) - 1 : -1]
    ref = ref.gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(res.log_probs), ref, atol=1e-4, rtol=0)


def test_greedy_is_argmax_and_batch_independent(sampler, model):
    greedy = [GenRequest(prompt_ids=p, max_tokens=5, temperature=0.0) for p in PROMPTS]
    batched = sampler.generate(greedy)
    single = [sampler.generate([r])[0] for r in greedy]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    for req, res in zip(greedy, batched, strict=True):
        ids = list(req.prompt_ids)
        for tok, lp in zip(res.token_ids, res.log_probs, strict=True):
            logits = _forward_logits(model, ids)[-1]
            assert tok == int(logits.argmax())
            # greedy rows report temperature-1 log-probs
            assert abs(lp - float(logits.log_softmax(-1)[tok])) < 1e-4
            ids.append(tok)


def test_seeded_sampling_is_deterministic(sampler):
    def run(seed):
        return sampler.generate([GenRequest(prompt_ids=PROMPTS[1], max_tokens=8, seed=seed)])[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)
    # the same seed inside a larger batch gives the same draw
    batch = sampler.generate([GenRequest(prompt_ids=PROMPTS[1], max_tokens=8, seed=7)] + [
        GenRequest(prompt_ids=p, max_tokens=8) for p in PROMPTS
    ])  # fmt: skip
    assert batch[0].token_ids == run(7)


def test_unseeded_samples_differ(sampler):
    res = sampler.generate([GenRequest(prompt_ids=PROMPTS[0], max_tokens=8) for _ in range(4)])
    assert len({tuple(r.token_ids) for r in res}) > 1


def test_eos_stops_and_is_returned(model):
    probe = HFSampler(model, [EOS], 256, pad_token_id=PAD)
    free = probe.generate([GenRequest(prompt_ids=PROMPTS[2], max_tokens=8, temperature=0.0)])[0].token_ids
    stop_tok = free[2]
    first = free.index(stop_tok)
    s = HFSampler(model, [stop_tok], 256, pad_token_id=PAD)
    res = s.generate([GenRequest(prompt_ids=PROMPTS[2], max_tokens=8, temperature=0.0)])[0]
    assert res.token_ids == free[: first + 1] and res.finish_reason == "stop"
    ignored = s.generate([GenRequest(prompt_ids=PROMPTS[2], max_tokens=8, temperature=0.0, ignore_eos=True)])[0]
    assert ignored.token_ids == free
    # a request's stop_token_ids work the same way
    res2 = probe.generate(
        [GenRequest(prompt_ids=PROMPTS[2], max_tokens=8, temperature=0.0, stop_token_ids=(stop_tok,))]
    )
    assert res2[0].token_ids == free[: first + 1]


def test_top_k_one_is_greedy_with_zero_logprob(sampler):
    greedy = sampler.generate([GenRequest(prompt_ids=PROMPTS[3], max_tokens=5, temperature=0.0)])[0]
    topk1 = sampler.generate([GenRequest(prompt_ids=PROMPTS[3], max_tokens=5, temperature=1.0, top_k=1)])[0]
    assert topk1.token_ids == greedy.token_ids
    assert all(abs(lp) < 1e-6 for lp in topk1.log_probs)


def test_top_p_matches_loop_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 2
    top_p = torch.tensor([0.5, 0.9, 1.0])
    top_k = torch.tensor([-1, 5, 3])
    got = HFSampler._apply_top_k_top_p(logits, top_k, top_p)
    for b in range(3):
        order = logits[b].argsort(descending=True).tolist()
        keep = order[: top_k[b]] if top_k[b] > 0 else order
        probs = logits[b, keep].softmax(-1)
        kept, mass = [], 0.0
        for tok, p in zip(keep, probs.tolist(), strict=True):
            if mass >= float(top_p[b]):
                break
            kept.append(tok)
            mass += p
        expect = torch.full_like(logits[b], float("-inf"))
        expect[kept] = logits[b, kept]
        torch.testing.assert_close(got[b], expect)


def test_repetition_penalty_rule():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = HFSampler._apply_repetition_penalty(logits, seen, torch.tensor([[2.0]]))
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))


def test_bad_requests_raise():
    with pytest.raises(ValueError, match="max_tokens=0"):
        GenRequest(prompt_ids=[1], max_tokens=0)
    with pytest.raises(ValueError, match="top_p=0"):
        GenRequest(prompt_ids=[1], max_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="prompt_ids"):
        GenRequest(prompt_ids=[], max_tokens=1)


# ----------------------------------------------------------------------------------------------------------------
# hf rollout: server (no Ray)


def test_server_generate_and_lengths(sampler):
    from verl.workers.rollout.replica import TokenOutput

    server = _server(sampler, prompt_length=32, response_length=8)

    async def run():
        return await asyncio.gather(
            server.generate(
                prompt_ids=PROMPTS[0], sampling_params={"temperature": 1.0, "logprobs": True}, request_id="a"
            ),
            server.generate(
                prompt_ids=PROMPTS[1], sampling_params={"temperature": 1.0, "max_tokens": 3}, request_id="b"
            ),
            server.generate(prompt_ids=[5] * 30, sampling_params={"temperature": 0, "logprobs": True}, request_id="c"),
        )

    out = asyncio.run(run())
    assert all(isinstance(o, TokenOutput) and o.stop_reason == "completed" and o.num_preempted == 0 for o in out)
    # default = response_length; explicit max_tokens; prompt 30 of 32 leaves room for 32 + 8 - 30 = 10 > 8
    assert [len(o.token_ids) for o in out] == [8, 3, 8]
    assert len(out[0].log_probs) == 8 and out[1].log_probs is None
    # budget rule: min(response_length, prompt_length + response_length - len(prompt))
    assert server.make_request([5] * 35, {}).max_tokens == 5
    with pytest.raises(ValueError, match="no room"):
        server.make_request([5] * 256, {})


def test_server_update_weights_changes_output(sampler, model):
    server = _server(sampler)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    greedy = {"temperature": 0.0}

    def gen():
        return asyncio.run(server.generate(prompt_ids=PROMPTS[1], sampling_params=dict(greedy))).token_ids

    before = gen()
    torch.manual_seed(123)
    # as the FSDP actor emits them: every HF key, lm_head tied to the embedding
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in original.items() if k != "lm_head.weight"}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    try:
        assert asyncio.run(server.update_weights(new, global_steps=3)) == len(new)
        assert server.global_steps == 3
        after = gen()
        assert after != before
        out = asyncio.run(server.generate(prompt_ids=PROMPTS[1], sampling_params=dict(greedy)))
        assert out.extra_fields["global_steps"] == 3
        with pytest.raises(ValueError, match="not in the rollout model"):
            asyncio.run(server.update_weights({"model.bogus.weight": torch.zeros(1)}))
    finally:
        asyncio.run(server.update_weights(original))
    assert gen() == before


def test_server_controls_are_noops(sampler):
    server = _server(sampler)

    async def run():
        await server.wake_up(tags=["weights"])
        await server.sleep()
        await server.clear_kv_cache()
        await server.release_kv_cache()
        await server.resume_kv_cache()
        await server.resume_generation()
        await server.start_profile()
        await server.stop_profile()
        await server.wait_for_requests_to_drain()
        return await server.abort_all_requests(reject_request=True)

    assert asyncio.run(run()) == {"aborted_count": 0, "request_ids": []}


def test_rollout_registered_in_verl():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import gtpo.cpu.hf_rollout as hf

    assert get_rollout_class("hf", "async") is hf.HFServerAdapter
    assert get_rollout_replica_class("hf") is hf.HFReplica


# ----------------------------------------------------------------------------------------------------------------
# environment


def test_env_helper():
    from gtpo.cpu import env

    e = env(extra_modules=["gtpo.verl_plugin.register"], base={"VERL_USE_EXTERNAL_MODULES": "x.y,gtpo.cpu.platform"})
    assert e["VERL_USE_EXTERNAL_MODULES"] == "gtpo.cpu.platform,gtpo.cpu.hf_rollout,gtpo.verl_plugin.register,x.y"
    assert (e["VERL_PLATFORM"], e["VERL_ENGINE_DEVICE"], e["VERL_ENGINE_VENDOR"]) == ("cpu", "cuda", "nvidia")
    assert e["HYDRA_FULL_ERROR"] == "1" and e["WANDB_MODE"] == "disabled" and e["TOKENIZERS_PARALLELISM"] == "false"
    assert str(Path(__file__).resolve().parents[1]) in e["PYTHONPATH"].split(":")
