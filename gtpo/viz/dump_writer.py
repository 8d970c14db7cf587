"""Token dumps written by the trainer: per-response records built from the batch's padded or jagged tensors.

The recipe trainer (``gtpo_sync``, ``_log_rollout_data``) calls :func:`records_from_batch` on the fields verl's v1
trainer keeps in TransferQueue and writes them with :func:`write_token_dump` to ``DIR/tokens_<step>.jsonl``, one JSON
object per response (:data:`TOKEN_DUMP_FIELDS`)::

    step             int         training step
    uid              str         prompt group id (all samples of a prompt share it)
    key              str | null  verl's per-sample key "<uid>_<session>_<index>"
    prompt           str | null  decoded prompt
    response_tokens  [str]       text of each response token (padding excluded)
    token_ids        [int]       token ids, same length
    advantages       [float] | null   per-token advantage, same length
    entropy          [float] | null   per-token old-policy entropy, same length
    score            float | null     sequence reward (sum of the token-level scores)
    acc              bool | null      verifier verdict when the reward returns "acc"
    model_mask       [int] | null     1 on the model's own tokens, 0 on tool-output tokens inside the response
                                      (multi-turn tool use; their advantage and entropy are written null); null
                                      when every token is the model's

A token whose own decoding is an incomplete UTF-8 sequence (byte-level BPE splits a character across tokens) is
decoded together with up to three following tokens; the span's text goes to its first token and the rest get
``""``, so ``"".join(response_tokens)`` still reads as the decoded response and positions stay 1:1 with ids.

numpy only: importing this module costs the trainer nothing (no matplotlib, no torch).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TOKEN_DUMP_FIELDS", "records_from_batch", "token_records", "write_token_dump"]

TOKEN_DUMP_FIELDS = (
    "step",
    "uid",
    "key",
    "prompt",
    "response_tokens",
    "token_ids",
    "advantages",
    "entropy",
    "score",
    "acc",
    "model_mask",
)


def to_numpy(x: Any, name: str) -> np.ndarray:
    """Tensor / array / list -> numpy without importing torch (bfloat16 has no numpy dtype: cast first)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        return x.numpy()
    try:
        return np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"{name}: cannot convert {type(x).__name__} to an array ({e})") from e


def piece_table(tokenizer: Any, ids: np.ndarray) -> dict[int, str]:
    """Decode each distinct id once (batched when the tokenizer allows)."""
    uniq = [int(i) for i in np.unique(ids)]
    if not uniq:  # an empty response; transformers 5's batch_decode([]) returns [""], not []
        return {}
    if hasattr(tokenizer, "batch_decode"):
        pieces = tokenizer.batch_decode([[i] for i in uniq], skip_special_tokens=False)
    else:
        pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in uniq]
    return dict(zip(uniq, pieces, strict=True))


def token_texts(tokenizer: Any, ids: Sequence[int], table: dict[int, str]) -> list[str]:
    """Per-token text for one response; incomplete UTF-8 pieces are merged with the following 1-3 tokens."""
    out = [table[int(i)] for i in ids]
    n = len(out)
    # Only positions with a replacement character need work; math text rarely has any.
    i = 0
    while i < n:
        if "\ufffd" not in out[i]:
            i += 1
            continue
        for j in range(i + 2, min(n, i + 4) + 1):
            span = tokenizer.decode([int(t) for t in ids[i:j]], skip_special_tokens=False)
            if "\ufffd" not in span:
                out[i:j] = [span] + [""] * (j - i - 1)
                i = j
                break
        else:
            i += 1  # a genuine U+FFFD or an unrecoverable byte run: keep the piece as decoded
    return out


def token_records(
    *,
    step: int,
    uids: Sequence[str] | np.ndarray,
    responses: Any,
    response_mask: Any,
    tokenizer: Any,
    advantages: Any = None,
    entropy: Any = None,
    scores: Any = None,
    acc: Any = None,
    prompts: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    max_groups: int | None = None,
    model_mask: Any = None,
) -> list[dict]:
    """Build token-dump records (one per response, schema in the module docstring) from padded batch tensors.

    Args:
        step: training step written into every record.
        uids: ``[B]`` prompt group ids (verl's ``uid``); rows may come in any order.
        responses: ``[B, L]`` int token ids (torch tensor, numpy array or nested list), right-padded.
        response_mask: ``[B, L]`` 1 on response tokens, 0 on padding; padding never reaches a record.
        tokenizer: anything with ``decode(ids, skip_special_tokens=...)`` (``batch_decode`` used when present).
        advantages: optional ``[B, L]`` float per-token advantages.
        entropy: optional ``[B, L]`` float per-token entropy.
        scores: optional ``[B]`` sequence rewards, or ``[B, L]`` token-level scores (summed over the mask).
        acc: optional ``[B]`` verifier verdicts (bool or 0/1).
        prompts: optional ``[B]`` decoded prompts.
        keys: optional ``[B]`` per-sample keys (verl's ``<uid>_<session>_<index>``).
        max_groups: keep only the first ``max_groups`` distinct uids (in order of first appearance), so the
            dump stays small on big batches; ``None`` keeps all.
        model_mask: optional ``[B, L]`` 1 on the model's own tokens (verl's ``response_mask``), 0 on the tool-output
            tokens a multi-turn response holds; those stay in the record, marked, with null advantage and entropy.

    Returns:
        List of dicts with keys :data:`TOKEN_DUMP_FIELDS`, grouped by uid (first appearance), rows of a group in
        input order. Floats are python floats (JSON-ready).
    """
    resp = to_numpy(responses, "responses")
    mask = to_numpy(response_mask, "response_mask")
    if resp.ndim != 2:
        raise ValueError(f"responses must be [batch, response_len], got shape {resp.shape}")
    if mask.shape != resp.shape:
        raise ValueError(f"response_mask shape {mask.shape} != responses shape {resp.shape}")
    batch = resp.shape[0]
    mask = mask.astype(bool)
    uid_arr = np.asarray([str(u) for u in to_numpy(uids, "uids").tolist()], dtype=object)
    if uid_arr.shape != (batch,):
        raise ValueError(f"uids must have {batch} entries, got {uid_arr.shape[0]}")

    def per_token(x: Any, name: str) -> np.ndarray | None:
        if x is None:
            return None
        arr = to_numpy(x, name).astype(np.float64)
        if arr.shape != resp.shape:
            raise ValueError(f"{name} shape {arr.shape} != responses shape {resp.shape}")
        return arr

    adv = per_token(advantages, "advantages")
    ent = per_token(entropy, "entropy")
    own = None if model_mask is None else per_token(model_mask, "model_mask") != 0
    score_arr = None
    if scores is not None:
        score_arr = to_numpy(scores, "scores").astype(np.float64)
        if score_arr.shape == resp.shape:
            score_arr = np.where(mask, score_arr, 0.0).sum(-1)
        elif score_arr.shape != (batch,):
            raise ValueError(f"scores must be [batch] or [batch, response_len], got shape {score_arr.shape}")
    acc_arr = None
    if acc is not None:
        acc_arr = to_numpy(acc, "acc").reshape(-1)
        if acc_arr.shape != (batch,):
            raise ValueError(f"acc must have {batch} entries, got {acc_arr.shape[0]}")
    for name, seq in (("prompts", prompts), ("keys", keys)):
        if seq is not None and len(seq) != batch:
            raise ValueError(f"{name} must have {batch} entries, got {len(seq)}")
    if max_groups is not None and max_groups < 1:
        raise ValueError(f"max_groups={max_groups}: must be >= 1 or None")

    # Group rows by uid in order of first appearance (dict preserves insertion order).
    groups: dict[str, list[int]] = {}
    for row, u in enumerate(uid_arr):
        groups.setdefault(u, []).append(row)
    selected = list(groups.items())[: max_groups if max_groups is not None else None]
    rows = [r for _, rs in selected for r in rs]
    if not rows:
        return []
    table = piece_table(tokenizer, resp[rows][mask[rows]])

    def values(arr: np.ndarray | None, r: int, tool: np.ndarray | None) -> list | None:
        if arr is None:
            return None
        row = arr[r][mask[r]]
        return row.tolist() if tool is None else [None if t else float(v) for v, t in zip(row, tool, strict=True)]

    records = []
    for r in rows:
        valid = mask[r]
        ids = resp[r][valid].astype(np.int64)
        tool = None if own is None else ~own[r][valid]
        tool = tool if tool is not None and bool(tool.any()) else None
        records.append(
            {
                "step": int(step),
                "uid": uid_arr[r],
                "key": None if keys is None else str(keys[r]),
                "prompt": None if prompts is None else str(prompts[r]),
                "response_tokens": token_texts(tokenizer, ids, table),
                "token_ids": ids.tolist(),
                "advantages": values(adv, r, tool),
                "entropy": values(ent, r, tool),
                "score": None if score_arr is None else float(score_arr[r]),
                "acc": None if acc_arr is None else bool(acc_arr[r]),
                "model_mask": None if tool is None else (~tool).astype(int).tolist(),
            }
        )
    return records


def _as_list(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _padded(x: Any, padding: float) -> Any:
    """verl's TransferQueue holds per-sample fields as jagged nested tensors; pad them right to ``[B, L]``."""
    return x.to_padded_tensor(padding=padding) if getattr(x, "is_nested", False) else x


def records_from_batch(
    data: Any,
    *,
    tokenizer: Any,
    step: int,
    keys: Sequence[str] | None = None,
    max_groups: int | None = 8,
    entropy_field: str = "entropy",
) -> list[dict]:
    """Token-dump records from the fields the v1 trainer keeps in TransferQueue (verl 0.9.1).

    Args:
        data: mapping returned by ``tq.kv_batch_get`` (a TensorDict, or a dict in tests) with at least ``uid`` and
            ``responses``; used when present: ``prompts``, ``rm_scores``, ``advantages``, ``entropy``,
            ``response_mask`` (with jagged ``responses``: the tool tokens it marks 0 are kept in the records and
            marked, ``model_mask``; with padded ``responses``: the tokens it keeps) and ``extra_fields`` (the
            reward's ``acc`` in ``extra_fields[i]["reward_extra_info"]``). Per-sample tensors may be jagged nested
            ``[B, (T_i)]`` or padded ``[B, L]``.
        tokenizer: the trainer's tokenizer.
        step: training step.
        keys: ``batch.keys`` (``<uid>_<session>_<index>``), stored per record.
        max_groups: dump only the first ``max_groups`` prompt groups (``None``: all).
        entropy_field: the field of ``data`` holding the per-token entropy the records show.

    Returns:
        Records as :func:`token_records` builds them. With nested ``responses`` the token count of each row is
        its generated length, so padding never reaches a record.
    """
    if max_groups is not None and max_groups < 1:
        raise ValueError(f"max_groups={max_groups}: must be >= 1 or None")
    names = set(data.keys())
    missing = {"uid", "responses"} - names
    if missing:
        raise ValueError(f"records_from_batch: missing field(s) {sorted(missing)}; got {sorted(names)}")
    raw = data["responses"]
    responses = _padded(raw, 0)
    model_mask = None
    if getattr(raw, "is_nested", False):
        lengths = to_numpy(raw.offsets().diff(), "responses lengths")
        mask = np.arange(responses.shape[1])[None, :] < lengths[:, None]
        if "response_mask" in names:
            model_mask = to_numpy(_padded(data["response_mask"], 0), "response_mask")
    elif "response_mask" in names:
        mask = _padded(data["response_mask"], 0)
    else:
        raise ValueError("records_from_batch: padded 'responses' need a 'response_mask' field")
    uids = [str(u) for u in _as_list(data["uid"])]

    # Choose rows first, so prompts are decoded only for the groups dumped.
    groups: dict[str, list[int]] = {}
    for row, u in enumerate(uids):
        groups.setdefault(u, []).append(row)
    rows = [r for _, rs in list(groups.items())[:max_groups] for r in rs]

    def take(name: str, padding: float = 0.0) -> np.ndarray | None:
        if name not in names:
            return None
        return to_numpy(_padded(data[name], padding), name)[rows]

    acc = None
    if "extra_fields" in names:
        infos = [e.get("reward_extra_info", {}) if isinstance(e, dict) else {} for e in _as_list(data["extra_fields"])]
        accs = [infos[r].get("acc") for r in rows]
        acc = accs if all(a is not None for a in accs) else None
    prompts = None
    if "prompts" in names:
        prompt_ids = take("prompts")
        prompt_lens = (
            to_numpy(data["prompts"].offsets().diff(), "prompts lengths")[rows]
            if getattr(data["prompts"], "is_nested", False)
            else None
        )
        prompts = [
            tokenizer.decode((p[: prompt_lens[i]] if prompt_lens is not None else p).tolist(), skip_special_tokens=True)
            for i, p in enumerate(prompt_ids)
        ]
    return token_records(
        step=step,
        uids=[uids[r] for r in rows],
        responses=to_numpy(responses, "responses")[rows],
        response_mask=np.asarray(to_numpy(mask, "response_mask"))[rows],
        tokenizer=tokenizer,
        advantages=take("advantages"),
        entropy=take(entropy_field),
        scores=take("rm_scores"),
        acc=acc,
        prompts=prompts,
        keys=None if keys is None else [str(keys[r]) for r in rows],
        model_mask=None if model_mask is None else model_mask[rows],
    )


def write_token_dump(records: Sequence[dict], path: str | Path) -> Path:
    """Write records as JSONL (UTF-8, one per line); creates the parent folder. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, allow_nan=True) + "\n")
    return path
