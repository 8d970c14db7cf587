"""The CPU demo's task and assets: the reward of ``say <d>`` -> ``<d>``, the word-level tokenizer, the random tiny
Qwen2 model and the parquet files, built once per recipe hash and seed (details in :mod:`gtpo.cpu.demo`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from gtpo.cpu.asset_cache import AssetPaths, build_once

DEMO_VERSION = 1
DATA_SOURCE = "cpu_demo/say_digit"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|im_end|>", "<unk>"
NEWLINE = "\n"
DIGITS = tuple(str(d) for d in range(10))
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FILLER_WORDS = tuple("the a is and of to it yes no ok i you what number answer = .".split())
# Word-level vocabulary in id order; "\n" is appended last as an added token (see module docstring).
WORDS = ("say", *DIGITS, *NUMBER_WORDS, *FILLER_WORDS)
CHAT_TEMPLATE = "{%- for message in messages %}{{- message['content'] }}{%- endfor %}"

MODEL_RECIPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
DATA_RECIPE = dict(repeats=100, val_repeats=1)


# ----------------------------------------------------------------------------------------------------------------
# reward


def score_response(response: str, target: str) -> float:
    """1.0 if the first whitespace-separated word of ``response`` equals ``target`` (stripped), else 0.0."""
    words = response.split()
    return 1.0 if words and words[0] == str(target).strip() else 0.0


def compute_score(data_source=None, solution_str: str = "", ground_truth: str = "", extra_info=None, **kwargs) -> float:
    """verl custom reward (``reward.custom_reward_function``): the demo's 0/1 reward of a decoded response."""
    if solution_str is None:
        return 0.0
    return score_response(str(solution_str), str(ground_truth))


# ----------------------------------------------------------------------------------------------------------------
# assets


DemoAssets = AssetPaths


def build_tokenizer():
    """The demo's word-level tokenizer as a transformers fast tokenizer (43 tokens, ``"\\n"`` is one token)."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *WORDS))}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # An added token is matched before the whitespace pre-tokenizer would drop it.
    core.add_tokens([AddedToken(NEWLINE, special=False, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(vocab_size: int, seed: int, pad_token_id: int, eos_token_id: int):
    """Random tiny ``Qwen2ForCausalLM`` (float32) initialised from ``seed``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
        **MODEL_RECIPE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    return model


def build_rows(repeats: int, split: str) -> list[dict]:
    """verl RL rows: the ten prompts ``say <d>`` in order 0..9, the block repeated ``repeats`` times."""
    rows = []
    for r in range(repeats):
        for d in DIGITS:
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"say {d}"}],
                    "ability": "toy",
                    "reward_model": {"style": "rule", "ground_truth": d},
                    "extra_info": {"split": split, "index": r * len(DIGITS) + int(d)},
                }
            )
    return rows


def recipe_key(seed: int) -> str:
    """Hash of everything the assets are built from (recipe constants, seed, library versions)."""
    import tokenizers
    import transformers

    blob = json.dumps(
        {
            "version": DEMO_VERSION,
            "tokens": [*SPECIAL_TOKENS, *WORDS, NEWLINE],
            "template": CHAT_TEMPLATE,
            "model": MODEL_RECIPE,
            "data": DATA_RECIPE,
            "seed": seed,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_into(folder: Path, seed: int) -> None:
    import pandas as pd

    tok = build_tokenizer()
    tok.save_pretrained(folder / "tokenizer")
    model = build_model(len(tok), seed, tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(folder / "model", safe_serialization=True)
    (folder / "data").mkdir()
    pd.DataFrame(build_rows(DATA_RECIPE["repeats"], "train")).to_parquet(folder / "data" / "train.parquet", index=False)
    pd.DataFrame(build_rows(DATA_RECIPE["val_repeats"], "test")).to_parquet(
        folder / "data" / "val.parquet", index=False
    )
    (folder / "RECIPE.json").write_text(
        json.dumps({"version": DEMO_VERSION, "seed": seed, "model": MODEL_RECIPE, "data": DATA_RECIPE}, indent=1)
    )


def build_demo_assets(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> DemoAssets:
    """Build (once per recipe hash and seed) and return the demo assets; safe to call concurrently."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")
    return build_once(cache_dir, f"cpu-demo-{recipe_key(seed)}", lambda folder: _build_into(folder, seed))
