"""The CPU demo's tasks and assets: the reward of ``say <d>``, the word-level tokenizer, the random tiny Qwen2 model
and the parquet files, built once per recipe hash, task and seed (details in :mod:`gtpo.cpu.demo`).

Two tasks share the prompts ``say <d>``, the tokenizer and the model; they differ in which response word is scored:

* ``say_digit`` (the demo's): reward 1 if the *first* word of the response is ``d``. One token decides the reward.
* ``second_word``: reward 1 if the *second* word is ``d``; the first word is free. The deciding token is not the
  first, and the first token of every response shares its reward without having earned it, so a token-level
  estimator has something to tell apart.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from gtpo.cpu.asset_cache import AssetPaths, build_once

DEMO_VERSION = 1
# task -> the 0-based index of the response word that must equal the prompt's digit
TASK_WORD_INDEX: dict[str, int] = {"say_digit": 0, "second_word": 1}
DEFAULT_TASK = "say_digit"
DATA_SOURCE_PREFIX = "cpu_demo/"
DATA_SOURCE = DATA_SOURCE_PREFIX + DEFAULT_TASK

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
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    rope_theta=10_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
DATA_RECIPE = dict(repeats=100, val_repeats=1)


# ----------------------------------------------------------------------------------------------------------------
# reward


def check_task(task: str) -> str:
    """``task`` when it is one of :data:`TASK_WORD_INDEX`, else a ValueError naming it and the known tasks."""
    if task not in TASK_WORD_INDEX:
        raise ValueError(f"task={task!r}: unknown; known: {', '.join(TASK_WORD_INDEX)}")
    return task


def task_data_source(task: str) -> str:
    """The ``data_source`` of the task's parquet rows (it selects the task's reward in :func:`compute_score`)."""
    return DATA_SOURCE_PREFIX + check_task(task)


def score_response(response: str, target: str, word_index: int = 0) -> float:
    """1.0 if whitespace-separated word ``word_index`` of ``response`` equals ``target`` (stripped), else 0.0."""
    words = response.split()
    return 1.0 if len(words) > word_index and words[word_index] == str(target).strip() else 0.0


_SOURCE_WORD_INDEX = {task_data_source(task): index for task, index in TASK_WORD_INDEX.items()}


def compute_score(data_source=None, solution_str: str = "", ground_truth: str = "", extra_info=None, **kwargs) -> float:
    """verl custom reward (``reward.custom_reward_function``): the 0/1 reward of a decoded response.

    The rows' ``data_source`` (``cpu_demo/<task>``) selects the scored word; any other source raises, naming it: the
    demo's reward is only ever configured for the demo's own parquet files, so another source is a wiring error.
    """
    source = DATA_SOURCE if data_source is None else str(data_source)
    word_index = _SOURCE_WORD_INDEX.get(source)
    if word_index is None:
        raise ValueError(f"data_source={source!r}: not a CPU demo task; known: {', '.join(_SOURCE_WORD_INDEX)}")
    if solution_str is None:
        return 0.0
    return score_response(str(solution_str), str(ground_truth), word_index)


# ----------------------------------------------------------------------------------------------------------------
# assets


DemoAssets = AssetPaths


def build_tokenizer():
    """The demo's word-level tokenizer as a transformers fast tokenizer (43 tokens, ``"\\n"`` is one token)."""
    return word_level_tokenizer(SPECIAL_TOKENS, WORDS, CHAT_TEMPLATE)


def word_level_tokenizer(special_tokens: tuple[str, ...], words: tuple[str, ...], chat_template: str):
    """A fast tokenizer of whole words: ``special_tokens`` first (``<unk>``, ``<|endoftext|>``, ``<|im_end|>`` among
    them), then ``words``, with ``"\\n"`` one token as verl's Qwen token builder requires."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*special_tokens, *words))}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    # An added token is matched before the whitespace pre-tokenizer would drop it.
    core.add_tokens([AddedToken(NEWLINE, special=False, normalized=False)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=UNK_TOKEN)
    tok.chat_template = chat_template
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


def build_rows(repeats: int, split: str, task: str = DEFAULT_TASK) -> list[dict]:
    """verl RL rows of ``task``: the ten prompts ``say <d>`` in order 0..9, the block repeated ``repeats`` times."""
    source = task_data_source(task)
    rows = []
    for r in range(repeats):
        for d in DIGITS:
            rows.append(
                {
                    "data_source": source,
                    "prompt": [{"role": "user", "content": f"say {d}"}],
                    "ability": "toy",
                    "reward_model": {"style": "rule", "ground_truth": d},
                    "extra_info": {"split": split, "index": r * len(DIGITS) + int(d)},
                }
            )
    return rows


def recipe_key(seed: int, task: str = DEFAULT_TASK) -> str:
    """Hash of everything the assets are built from (recipe constants, task, seed, library versions)."""
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
            # the default task is left out, so its cache folders from before tasks existed stay valid
            **({} if task == DEFAULT_TASK else {"task": check_task(task)}),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_into(folder: Path, seed: int, task: str) -> None:
    import pandas as pd

    tok = build_tokenizer()
    tok.save_pretrained(folder / "tokenizer")
    model = build_model(len(tok), seed, tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(folder / "model", safe_serialization=True)
    (folder / "data").mkdir()
    pd.DataFrame(build_rows(DATA_RECIPE["repeats"], "train", task)).to_parquet(
        folder / "data" / "train.parquet", index=False
    )
    pd.DataFrame(build_rows(DATA_RECIPE["val_repeats"], "test", task)).to_parquet(
        folder / "data" / "val.parquet", index=False
    )
    (folder / "RECIPE.json").write_text(
        json.dumps(
            {"version": DEMO_VERSION, "task": task, "seed": seed, "model": MODEL_RECIPE, "data": DATA_RECIPE}, indent=1
        )
    )


def build_demo_assets(
    cache_dir: str | os.PathLike | None = None, seed: int = 0, task: str = DEFAULT_TASK
) -> DemoAssets:
    """Build (once per recipe hash, task and seed) and return the demo assets; safe to call concurrently.

    The model depends on the seed only, so the tasks of one seed start from the same weights."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")
    check_task(task)
    return build_once(cache_dir, f"cpu-demo-{recipe_key(seed, task)}", lambda folder: _build_into(folder, seed, task))
