"""Reading dumps for the heatmap: the recipe's token dumps and verl's text-only rollout dumps, as :class:`Response`.

1. **verl rollout dumps.** With ``trainer.rollout_data_dir=DIR`` verl 0.9.1 (v1 trainer, ``_log_rollout_data``)
   writes ``DIR/<step>.jsonl``, one line per response: ``{"input", "output", "gts", "score", "step", "uid"}``, where
   ``input``/``output`` are decoded text (special tokens skipped), ``score`` is the summed ``rm_scores`` and
   ``uid`` is the per-sample key ``<prompt uid>_<session>_<index>``. No token ids, advantages or entropies are
   stored, so these render with ``--color score`` or ``--color none``; the text is split into words (or into
   tokens with ``--tokenizer``). Validation dumps (``trainer.validation_data_dir``) have the same shape plus the
   reward's extra keys (``acc``, ``pred``).
2. **The recipe's token dumps** ``DIR/tokens_<step>.jsonl`` (schema in :mod:`gtpo.viz.dump_writer`).

Correctness is ``acc`` when present, else ``score > correct_threshold`` (default 0, right for both verl's
``math_dapo`` scores of +-1 and 0/1 verifiers).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gtpo.viz.dump_writer import piece_table, token_texts

__all__ = ["Response", "find_dump", "load_responses", "responses_from_records"]

_KEY_RE = re.compile(r"^(?P<uid>.+)_(\d+)_(\d+)$")
_WORD_RE = re.compile(r"\s+|\w+|[^\w\s]", re.UNICODE)


@dataclass
class Response:
    """One response ready to render. ``advantages`` / ``entropy`` are ``[T]`` float arrays or None."""

    uid: str
    tokens: list[str]
    step: int | None = None
    key: str | None = None
    prompt: str | None = None
    token_ids: list[int] | None = None
    advantages: np.ndarray | None = None
    entropy: np.ndarray | None = None
    score: float | None = None
    acc: bool | None = None
    correct: bool | None = None
    model_mask: np.ndarray | None = None  # [T] bool: False on tool-output tokens (multi-turn), None: all the model's

    @property
    def tool(self) -> np.ndarray:
        """``[T]`` bool: the tool-output tokens of the response (none without a ``model_mask``)."""
        if self.model_mask is None:
            return np.zeros(len(self.tokens), dtype=bool)
        return ~self.model_mask


def _float_array(values: Any, n: int, field: str, where: str) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    if arr.shape != (n,):
        raise ValueError(f"{where}: {field} has {arr.shape[0]} values for {n} response_tokens")
    return arr


def _model_mask(values: Any, n: int, where: str) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray(values)
    if arr.shape != (n,) or not np.isin(arr, (0, 1)).all():
        raise ValueError(f"{where}: model_mask must hold {n} values of 0 or 1")
    return arr.astype(bool)


def _group_uid_from_key(key: str) -> str:
    m = _KEY_RE.match(key)
    return m.group("uid") if m else key


def _parse_record(rec: dict, where: str, tokenizer: Any, correct_threshold: float) -> Response:
    if "response_tokens" in rec:  # our token dump
        tokens = rec["response_tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{where}: response_tokens must be a list of strings")
        n = len(tokens)
        ids = rec.get("token_ids")
        if ids is not None and len(ids) != n:
            raise ValueError(f"{where}: token_ids has {len(ids)} values for {n} response_tokens")
        if "uid" not in rec:
            raise ValueError(f"{where}: token-dump record has no 'uid'")
        score = rec.get("score", rec.get("reward"))
        resp = Response(
            uid=str(rec["uid"]),
            tokens=tokens,
            step=rec.get("step"),
            key=rec.get("key"),
            prompt=rec.get("prompt"),
            token_ids=ids,
            advantages=_float_array(rec.get("advantages"), n, "advantages", where),
            entropy=_float_array(rec.get("entropy"), n, "entropy", where),
            score=None if score is None else float(score),
            acc=None if rec.get("acc") is None else bool(rec["acc"]),
            model_mask=_model_mask(rec.get("model_mask"), n, where),
        )
    elif "output" in rec:  # verl's rollout / validation dump (text only)
        text = rec["output"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'output' must be a string, got {type(text).__name__}")
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            tokens = token_texts(tokenizer, ids, piece_table(tokenizer, np.asarray(ids, dtype=np.int64)))
        else:
            ids, tokens = None, _WORD_RE.findall(text)
        key = rec.get("uid")
        # verl writes the per-sample key; without one, samples of a prompt share the prompt text.
        uid = _group_uid_from_key(str(key)) if key is not None else str(rec.get("input"))
        score = rec.get("score")
        acc = rec.get("acc")
        resp = Response(
            uid=uid,
            tokens=tokens,
            step=rec.get("step"),
            key=None if key is None else str(key),
            prompt=rec.get("input"),
            token_ids=None if ids is None else list(ids),
            score=None if score is None else float(score),
            acc=None if acc is None else bool(acc),
        )
    else:
        raise ValueError(
            f"{where}: neither a token-dump record ('response_tokens') nor a verl dump record ('output'); "
            f"keys: {sorted(rec)}"
        )
    if resp.acc is not None:
        resp.correct = resp.acc
    elif resp.score is not None and not math.isnan(resp.score):
        resp.correct = resp.score > correct_threshold
    return resp


def find_dump(path: str | Path, step: int | None = None) -> Path:
    """Resolve ``--input``: a file as is; a folder -> ``tokens_<step>.jsonl`` if any, else verl's ``<step>.jsonl``.

    Without ``step`` the latest step wins; our token dumps win over verl's text dumps.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"--input {path}: no such file or folder")
    ours = {int(p.stem[len("tokens_") :]): p for p in path.glob("tokens_*.jsonl") if p.stem[7:].isdigit()}
    verls = {int(p.stem): p for p in path.glob("*.jsonl") if p.stem.isdigit()}
    for found in (ours, verls):
        if found:
            if step is None:
                return found[max(found)]
            if step in found:
                return found[step]
    raise ValueError(f"--input {path}: no tokens_<step>.jsonl or <step>.jsonl" + (f" for step {step}" if step else ""))


def load_responses(path: str | Path, *, tokenizer: Any = None, correct_threshold: float = 0.0) -> list[Response]:
    """Read a token dump or a verl rollout dump (auto-detected per record). Blank lines are skipped."""
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            out.append(_parse_record(rec, where, tokenizer, correct_threshold))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def responses_from_records(records: list[dict], *, correct_threshold: float = 0.0) -> list[Response]:
    """In-memory token-dump records (as :func:`gtpo.viz.dump_writer.token_records` returns them) -> responses."""
    return [_parse_record(rec, f"record {i}", None, correct_threshold) for i, rec in enumerate(records)]
