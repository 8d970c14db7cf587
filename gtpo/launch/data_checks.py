"""The training and validation data, checked before Ray starts: each file, its columns, its text, its prompts' length.

verl reads the data in its TaskRunner, after Ray and every worker have started, and fails there with a traceback of
35-38 frames (a missing, empty, unreadable or malformed parquet file, a missing column), or not at all: a prompt
stored as bytes becomes an empty prompt, and a prompt longer than ``data.max_prompt_length`` is left-truncated by
verl's agent loop although ``data.truncation=error`` says to refuse it. :func:`check_data` (the driver of a real run,
:func:`gtpo.launch.checks.prepare_launch`, and the preflight) refuses each in one line naming the file and the key:

* each of ``data.train_files`` / ``data.val_files`` exists, is a parquet file and has rows;
* it has the columns verl reads: ``data.prompt_key``, ``data_source`` and ``reward_model`` with ``ground_truth``
  (verl's reward managers read both by these names);
* every prompt is a list of chat messages whose ``role`` and ``content`` are text (valid UTF-8, which a bytes
  column is not);
* with ``data.truncation=error`` (and ``data.filter_overlong_prompts=false``), every prompt, as the model's chat
  template renders it (the tokenizer of ``actor_rollout_ref.model``), fits ``data.max_prompt_length`` tokens.
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

__all__ = ["DataError", "check_data", "check_data_file", "prompt_tokenizer"]

# Columns verl's reward managers read by name (verl/experimental/reward_loop/reward_manager/naive.py).
REWARD_COLUMNS = ("data_source", "reward_model")
# Tokens a tokenizer may add beyond the rendered text (a BOS): a prompt of this many bytes fewer than the limit fits.
SPECIAL_TOKENS_SLACK = 8


class DataError(ValueError):
    """A data file no run can train on: one line naming the file, the key and what is wrong."""


def _files(config: Any, key: str) -> list[str]:
    value = OmegaConf.select(config, key, default=None)
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _message_problem(prompt: Any) -> str | None:
    """Why ``prompt`` (one row's prompt column) is not a list of chat messages of text, or None."""
    if not isinstance(prompt, list | tuple) or not prompt:
        return f"a {type(prompt).__name__}, not a non-empty list of chat messages"
    for message in prompt:
        if not isinstance(message, dict):
            return f"a message that is a {type(message).__name__}, not a dict"
        for field in ("role", "content"):
            value = message.get(field)
            if isinstance(value, bytes):
                return f"a message {field} stored as bytes, not UTF-8 text (it would reach the model empty)"
            if not isinstance(value, str):
                return f"a message without a text {field} ({type(value).__name__})"
    return None


def check_data_file(path: str, key: str, config: Any, tokenizer: Any = None) -> int:
    """Refuse the data file ``path`` of ``key`` (``DataError``, one line) unless verl can train on it; returns its
    rows. ``tokenizer``: the model's, to measure the prompts when ``data.truncation=error``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = f"{key}: {path}"
    if not os.path.isfile(path):
        raise DataError(f"{where} does not exist" if not os.path.exists(path) else f"{where} is not a file")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{where} is not a readable parquet file ({type(err).__name__}: {err})") from None
    if table.num_rows == 0:
        raise DataError(f"{where} has no rows")
    prompt_key = str(OmegaConf.select(config, "data.prompt_key", default="prompt"))
    missing = [c for c in (prompt_key, *REWARD_COLUMNS) if c not in table.column_names]
    if missing:
        raise DataError(f"{where} has no column {', '.join(missing)} (data.prompt_key={prompt_key}; verl reads "
                        f"{', '.join(REWARD_COLUMNS)}); columns: {', '.join(table.column_names)}")  # fmt: skip
    try:
        table.column(prompt_key).validate(full=True)
    except pa.ArrowInvalid as err:
        raise DataError(f"{where}: column {prompt_key} is not valid text ({err})") from None
    prompts = table.column(prompt_key).to_pylist()
    for row, prompt in enumerate(prompts):
        problem = _message_problem(prompt)
        if problem:
            raise DataError(f"{where}: row {row} of column {prompt_key} holds {problem}")
    for row, reward in enumerate(table.column("reward_model").to_pylist()):
        if not isinstance(reward, dict) or reward.get("ground_truth") is None:
            raise DataError(f"{where}: row {row} of column reward_model has no ground_truth")
    if tokenizer is not None:
        _check_prompt_lengths(where, prompts, config, tokenizer)
    return table.num_rows


def _check_prompt_lengths(where: str, prompts: list, config: Any, tokenizer: Any) -> None:
    """Every prompt rendered by the chat template (as verl renders it) within ``data.max_prompt_length`` tokens."""
    limit = int(OmegaConf.select(config, "data.max_prompt_length"))
    kwargs = OmegaConf.select(config, "data.apply_chat_template_kwargs", default=None) or {}
    kwargs = dict(OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else kwargs)
    for row, prompt in enumerate(prompts):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kwargs)
        if len(text.encode()) + SPECIAL_TOKENS_SLACK <= limit:
            continue  # no token is shorter than a byte of the text: it fits, without tokenizing
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **kwargs)
        length = len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding under transformers 5
        if length > limit:
            raise DataError(
                f"{where}: row {row}'s prompt is {length} tokens > data.max_prompt_length={limit} with "
                "data.truncation=error (verl's agent loop would cut it to its last tokens and train on them); "
                "shorten or drop such rows, set data.filter_overlong_prompts=true, or choose another data.truncation"
            )


def prompt_tokenizer(config: Any) -> Any:
    """The model's tokenizer where the prompts are to be measured (``data.truncation=error`` and
    ``data.filter_overlong_prompts`` off), else None; ``DataError`` when it does not load."""
    data = config.data
    if str(data.get("truncation", "error")) != "error" or data.get("filter_overlong_prompts", False):
        return None
    from transformers import AutoTokenizer

    model = OmegaConf.select(config, "actor_rollout_ref.model", default={}) or {}
    path = model.get("tokenizer_path") or model.get("path")
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=bool(model.get("trust_remote_code", False)))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        raise DataError(
            f"actor_rollout_ref.model.path={path}: no tokenizer loads ({type(err).__name__}: {err}); "
            "data.truncation=error measures every prompt with it"
        ) from None


def check_data(config: Any) -> dict[str, int]:
    """:func:`check_data_file` of every training and validation file; ``{key: rows}``. The prompts are measured
    only where ``data.truncation=error`` asks for a refusal and ``data.filter_overlong_prompts`` does not drop
    them first."""
    tokenizer = prompt_tokenizer(config)
    rows = {}
    for key in ("data.train_files", "data.val_files"):
        files = _files(config, key)
        if key == "data.train_files" and not files:
            raise DataError(f"{key} is empty")
        rows[key] = sum(check_data_file(path, key, config, tokenizer) for path in files)
    return rows
