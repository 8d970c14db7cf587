"""The CPU demo's tool task: the answer is not in the prompt, and only a call of the ``lookup`` tool reveals it.

Through verl's real ``ToolAgentLoop`` (``@register("tool_agent")``), on the tiny model, from scratch:

* The prompt is ``find <key>`` (``key`` one of four colours). Each training row holds its own secret digit under
  that key, drawn uniformly for the row, so a key says nothing about its digit: the model cannot answer from the
  prompt, only copy what the tool returns.
* A call is the word ``lookup`` anywhere in an assistant turn; the parser (:mod:`gtpo.cpu.lookup_tool`, registered
  as ``gtpo_cpu_lookup`` through verl's ``ToolParser.register`` when verl's agent-loop worker imports that module
  for the tool config's ``LookupTool``) stops generation at that token and calls the tool. The call takes no
  argument: the tool knows the key the prompt named, and its digit, from the row's ``extra_info.tools_kwargs``
  (``create_kwargs``), the way verl's own examples hand a row's data to its tool. A 77k-parameter model that must
  also learn to copy the key into the call would need far more steps than the demo's budget.
* The tool's reply reaches the model as ``<|im_start|> result <d> <|im_end|>`` (the chat template's tool turn):
  verl marks those tokens 0 in ``response_mask``. After it a second assistant turn answers (at most two turns).
* Reward (:func:`score`): 1 if the response called the tool and the first word after the tool's reply is the secret
  digit, else 0; a response that never calls scores 0 (the digit is random, so guessing would score 0.1 at best).

The model is the demo's (:data:`gtpo.cpu.demo_task.MODEL_RECIPE`, random). The vocabulary (22 word-level tokens)
keeps the random model's first success likely enough for RL from scratch: about 1 % of responses at step 1 (a call
among the first seven tokens, then the right digit by chance).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

from gtpo.cpu.asset_cache import AssetPaths, build_once
from gtpo.cpu.demo_task import (
    MODEL_RECIPE,
    NEWLINE,
    SPECIAL_TOKENS,
    build_model,
    word_level_tokenizer,
)

__all__ = [
    "CALL_WORD",
    "DATA_SOURCE",
    "KEYS",
    "PARSER_NAME",
    "build_rows",
    "build_tokenizer",
    "build_tool_task_assets",
    "score",
    "tool_config_path",
    "tool_task_overrides",
]

TASK_VERSION = 1
DATA_SOURCE = "cpu_demo/tool_lookup"
PARSER_NAME = "gtpo_cpu_lookup"
TOOL_NAME = "lookup"
CALL_WORD = "lookup"
REPLY_WORD = "result"
KEYS = ("red", "green", "blue", "gold")
DIGITS = tuple(str(d) for d in range(10))
WORDS = ("find", *KEYS, CALL_WORD, REPLY_WORD, *DIGITS)
# The user's and assistants' contents as they are; a tool turn as "<|im_start|> result <d> <|im_end|>" (its leading
# space keeps verl's token-id suffix check exact after any word); no generation prompt, no system text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- ' <|im_start|> " + REPLY_WORD + " ' + message['content'] + ' <|im_end|> ' }}"
    "{%- elif message['role'] in ('user', 'assistant') %}{{- message['content'] }}"
    "{%- endif %}"
    "{%- endfor %}"
)
DATA_RECIPE = dict(train_rows=1000, val_rows=20)
# Lengths of the task: "find <key>" is 2 tokens; a response is turn 1 (up to the call), the 4-token reply, turn 2.
MAX_PROMPT_TOKENS = 8
MAX_RESPONSE_TOKENS = 12


# ----------------------------------------------------------------------------------------------------------------
# reward


def score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response called the tool (``lookup``, then the reply ``result <d>``) and the first word after the
    reply is ``ground_truth``; else 0.0. Never raises."""
    words = str(solution_str or "").split()
    if CALL_WORD not in words:
        return 0.0
    after = words[words.index(CALL_WORD) + 1 :]
    if len(after) < 3 or after[0] != REPLY_WORD:  # no reply: the response budget ended at the call
        return 0.0
    return 1.0 if after[2] == str(ground_truth).strip() else 0.0


TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "The digit stored under the key the question names.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}


# ----------------------------------------------------------------------------------------------------------------
# assets


def build_tokenizer():
    """The task's word-level tokenizer (22 tokens, ``"\\n"`` one token as verl's Qwen token builder requires)."""
    return word_level_tokenizer(SPECIAL_TOKENS, WORDS, CHAT_TEMPLATE)


def build_rows(count: int, split: str, seed: int) -> list[dict]:
    """verl RL rows: ``find <key>`` with a secret digit per row, handed to the tool through ``tools_kwargs``."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for index in range(count):
        key, value = KEYS[index % len(KEYS)], rng.choice(DIGITS)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"find {key}"}],
                "ability": "toy",
                "reward_model": {"style": "rule", "ground_truth": value},
                "agent_name": "tool_agent",
                "extra_info": {
                    "split": split,
                    "index": index,
                    "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"key": key, "value": value}}},
                },
            }
        )
    return rows


def tool_config_path(assets: AssetPaths) -> str:
    """The verl tool config written beside the assets (``multi_turn.tool_config_path``)."""
    return str(Path(assets.model_dir).parent / "tools.yaml")


def _recipe_key(seed: int) -> str:
    import tokenizers
    import transformers

    blob = json.dumps(
        {
            "version": TASK_VERSION,
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
    import yaml

    tok = build_tokenizer()
    tok.save_pretrained(folder / "tokenizer")
    model = build_model(len(tok), seed, tok.pad_token_id, tok.eos_token_id)
    model.save_pretrained(folder / "model", safe_serialization=True)
    (folder / "data").mkdir()
    pd.DataFrame(build_rows(DATA_RECIPE["train_rows"], "train", seed)).to_parquet(folder / "data" / "train.parquet")
    pd.DataFrame(build_rows(DATA_RECIPE["val_rows"], "test", seed)).to_parquet(folder / "data" / "val.parquet")
    tool = {"class_name": "gtpo.cpu.lookup_tool.LookupTool", "config": {"type": "native"}, "tool_schema": TOOL_SCHEMA}
    tools = {"tools": [tool]}
    (folder / "tools.yaml").write_text(yaml.safe_dump(tools, sort_keys=False))
    (folder / "RECIPE.json").write_text(
        json.dumps({"version": TASK_VERSION, "task": "tool_lookup", "seed": seed, "model": MODEL_RECIPE}, indent=1)
    )


def build_tool_task_assets(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> AssetPaths:
    """Build (once per recipe hash and seed) and return the task's tokenizer, random model, data and tool config."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be a non-negative int")
    return build_once(cache_dir, f"cpu-tool-task-{_recipe_key(seed)}", lambda folder: _build_into(folder, seed))


def tool_task_overrides(assets: AssetPaths) -> list[str]:
    """The trainer settings of the task, after the demo's: verl's tool agent loop with the ``lookup`` tool, two
    assistant turns, and the task's lengths."""
    return [
        f"data.max_prompt_length={MAX_PROMPT_TOKENS}",
        f"data.max_response_length={MAX_RESPONSE_TOKENS}",
        f"actor_rollout_ref.rollout.prompt_length={MAX_PROMPT_TOKENS}",
        f"actor_rollout_ref.rollout.response_length={MAX_RESPONSE_TOKENS}",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.format={PARSER_NAME}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config_path(assets)}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ]
