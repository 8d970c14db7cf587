"""Token-level heatmaps: each sampled response drawn token by token, coloured by advantage or entropy.

GTPO (arXiv 2508.04349, Eqs. 3-6) and GTPO-trajectory (arXiv 2508.03772) move credit *inside* a response, so a
single scalar per response hides what the estimator did. This module shows it: for every prompt group (verl's
``uid``), the correct and the incorrect samples side by side, each token a box whose colour is

* ``advantage``: the per-token advantage on a diverging colormap (``RdBu``: red < 0 < blue), centred at 0 on a
  symmetric scale ``[-vmax, vmax]`` with ``vmax = max |A|`` over everything rendered (or ``--vmax``);
* ``entropy``: the old-policy per-token entropy on a sequential colormap (``YlOrRd``) over ``[0, vmax]``;
* ``score``: the response's sequence reward, copied to each token (the only signal verl's text dumps carry);
* ``none``: no colour.

Outputs: a self-contained HTML page (inline CSS, no external assets, every token HTML-escaped, whitespace made
visible, a hover title with the exact value, a colour legend) and a PNG drawn with matplotlib's Agg canvas.

Inputs
------
1. **verl rollout dumps.** With ``trainer.rollout_data_dir=DIR`` verl 0.9.1 (v1 trainer, ``_log_rollout_data``)
   writes ``DIR/<step>.jsonl``, one line per response: ``{"input", "output", "gts", "score", "step", "uid"}``, where
   ``input``/``output`` are decoded text (special tokens skipped), ``score`` is the summed ``rm_scores`` and
   ``uid`` is the per-sample key ``<prompt uid>_<session>_<index>``. No token ids, advantages or entropies are
   stored, so these render with ``--color score`` or ``--color none``; the text is split into words (or into
   tokens with ``--tokenizer``). Validation dumps (``trainer.validation_data_dir``) have the same shape plus the
   reward's extra keys (``acc``, ``pred``).
2. **Our token dumps** (:data:`TOKEN_DUMP_FIELDS`), written by the recipe trainer with :func:`token_records`
   to ``DIR/tokens_<step>.jsonl``, one JSON object per response::

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

Deliberate choices
------------------
* Correctness is ``acc`` when present, else ``score > correct_threshold`` (default 0, right for both verl's
  ``math_dapo`` scores of +-1 and 0/1 verifiers).
* A token whose own decoding is an incomplete UTF-8 sequence (byte-level BPE splits a character across tokens)
  is decoded together with up to three following tokens; the span's text goes to its first token and the rest
  get ``""``, so ``"".join(response_tokens)`` still reads as the decoded response and positions stay 1:1 with ids.
* The PNG is an overview: it keeps ``png_max_responses`` responses per column and ``png_max_tokens`` tokens per
  response (the HTML keeps everything) and uses one monospace text run per line, so glyphs outside the
  monospace font may drift from their boxes.
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ADVANTAGE_CMAP",
    "ENTROPY_CMAP",
    "COLOR_MODES",
    "TOKEN_DUMP_FIELDS",
    "Response",
    "ColorScale",
    "token_records",
    "records_from_batch",
    "write_token_dump",
    "load_responses",
    "find_dump",
    "render_html",
    "render_png",
    "render_tokens",
]

ADVANTAGE_CMAP = "RdBu"
ENTROPY_CMAP = "YlOrRd"
COLOR_MODES = ("advantage", "entropy", "score", "none")
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
)
# Advance width of DejaVu Sans Mono in em (1233 / 2048): one character = one layout unit in the PNG.
_MONO_ADVANCE_EM = 0.602
_MONO_FONT = "DejaVu Sans Mono"
_KEY_RE = re.compile(r"^(?P<uid>.+)_(\d+)_(\d+)$")
_WORD_RE = re.compile(r"\s+|\w+|[^\w\s]", re.UNICODE)


# --------------------------------------------------------------------------------------------------------------
# Building token dumps from the trainer's padded tensors
# --------------------------------------------------------------------------------------------------------------


def _to_numpy(x: Any, name: str) -> np.ndarray:
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


def _piece_table(tokenizer: Any, ids: np.ndarray) -> dict[int, str]:
    """Decode each distinct id once (batched when the tokenizer allows)."""
    uniq = [int(i) for i in np.unique(ids)]
    if hasattr(tokenizer, "batch_decode"):
        pieces = tokenizer.batch_decode([[i] for i in uniq], skip_special_tokens=False)
    else:
        pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in uniq]
    return dict(zip(uniq, pieces, strict=True))


def _token_texts(tokenizer: Any, ids: Sequence[int], table: dict[int, str]) -> list[str]:
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

    Returns:
        List of dicts with keys :data:`TOKEN_DUMP_FIELDS`, grouped by uid (first appearance), rows of a group in
        input order. Floats are python floats (JSON-ready).
    """
    resp = _to_numpy(responses, "responses")
    mask = _to_numpy(response_mask, "response_mask")
    if resp.ndim != 2:
        raise ValueError(f"responses must be [batch, response_len], got shape {resp.shape}")
    if mask.shape != resp.shape:
        raise ValueError(f"response_mask shape {mask.shape} != responses shape {resp.shape}")
    batch = resp.shape[0]
    mask = mask.astype(bool)
    uid_arr = np.asarray([str(u) for u in _to_numpy(uids, "uids").tolist()], dtype=object)
    if uid_arr.shape != (batch,):
        raise ValueError(f"uids must have {batch} entries, got {uid_arr.shape[0]}")

    def per_token(x: Any, name: str) -> np.ndarray | None:
        if x is None:
            return None
        arr = _to_numpy(x, name).astype(np.float64)
        if arr.shape != resp.shape:
            raise ValueError(f"{name} shape {arr.shape} != responses shape {resp.shape}")
        return arr

    adv = per_token(advantages, "advantages")
    ent = per_token(entropy, "entropy")
    score_arr = None
    if scores is not None:
        score_arr = _to_numpy(scores, "scores").astype(np.float64)
        if score_arr.shape == resp.shape:
            score_arr = np.where(mask, score_arr, 0.0).sum(-1)
        elif score_arr.shape != (batch,):
            raise ValueError(f"scores must be [batch] or [batch, response_len], got shape {score_arr.shape}")
    acc_arr = None
    if acc is not None:
        acc_arr = _to_numpy(acc, "acc").reshape(-1)
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
    table = _piece_table(tokenizer, resp[rows][mask[rows]])

    records = []
    for r in rows:
        valid = mask[r]
        ids = resp[r][valid].astype(np.int64)
        records.append(
            {
                "step": int(step),
                "uid": uid_arr[r],
                "key": None if keys is None else str(keys[r]),
                "prompt": None if prompts is None else str(prompts[r]),
                "response_tokens": _token_texts(tokenizer, ids, table),
                "token_ids": ids.tolist(),
                "advantages": None if adv is None else adv[r][valid].tolist(),
                "entropy": None if ent is None else ent[r][valid].tolist(),
                "score": None if score_arr is None else float(score_arr[r]),
                "acc": None if acc_arr is None else bool(acc_arr[r]),
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
) -> list[dict]:
    """Token-dump records from the fields the v1 trainer keeps in TransferQueue (verl 0.9.1).

    Args:
        data: mapping returned by ``tq.kv_batch_get`` (a TensorDict, or a dict in tests) with at least ``uid`` and
            ``responses``; used when present: ``prompts``, ``rm_scores``, ``advantages``, ``entropy``,
            ``response_mask`` (only when ``responses`` is already padded) and ``extra_fields`` (the reward's
            ``acc`` in ``extra_fields[i]["reward_extra_info"]``). Per-sample tensors may be jagged nested
            ``[B, (T_i)]`` or padded ``[B, L]``.
        tokenizer: the trainer's tokenizer.
        step: training step.
        keys: ``batch.keys`` (``<uid>_<session>_<index>``), stored per record.
        max_groups: dump only the first ``max_groups`` prompt groups (``None``: all).

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
    if getattr(raw, "is_nested", False):
        lengths = _to_numpy(raw.offsets().diff(), "responses lengths")
        mask = np.arange(responses.shape[1])[None, :] < lengths[:, None]
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
        return _to_numpy(_padded(data[name], padding), name)[rows]

    acc = None
    if "extra_fields" in names:
        infos = [e.get("reward_extra_info", {}) if isinstance(e, dict) else {} for e in _as_list(data["extra_fields"])]
        accs = [infos[r].get("acc") for r in rows]
        acc = accs if all(a is not None for a in accs) else None
    prompts = None
    if "prompts" in names:
        prompt_ids = take("prompts")
        prompt_lens = (
            _to_numpy(data["prompts"].offsets().diff(), "prompts lengths")[rows]
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
        responses=_to_numpy(responses, "responses")[rows],
        response_mask=np.asarray(_to_numpy(mask, "response_mask"))[rows],
        tokenizer=tokenizer,
        advantages=take("advantages"),
        entropy=take("entropy"),
        scores=take("rm_scores"),
        acc=acc,
        prompts=prompts,
        keys=None if keys is None else [str(keys[r]) for r in rows],
    )


def write_token_dump(records: Sequence[dict], path: str | Path) -> Path:
    """Write records as JSONL (UTF-8, one per line); creates the parent folder. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, allow_nan=True) + "\n")
    return path


# --------------------------------------------------------------------------------------------------------------
# Reading dumps
# --------------------------------------------------------------------------------------------------------------


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


def _float_array(values: Any, n: int, field: str, where: str) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.asarray([math.nan if v is None else float(v) for v in values], dtype=np.float64)
    if arr.shape != (n,):
        raise ValueError(f"{where}: {field} has {arr.shape[0]} values for {n} response_tokens")
    return arr


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
        )
    elif "output" in rec:  # verl's rollout / validation dump (text only)
        text = rec["output"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'output' must be a string, got {type(text).__name__}")
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            tokens = _token_texts(tokenizer, ids, _piece_table(tokenizer, np.asarray(ids, dtype=np.int64)))
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


# --------------------------------------------------------------------------------------------------------------
# Colours
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ColorScale:
    """Value -> RGBA mapping. ``advantage``/``score``: symmetric diverging; ``entropy``: sequential from 0."""

    mode: str
    vmin: float
    vmax: float

    @property
    def cmap_name(self) -> str | None:
        return {"advantage": ADVANTAGE_CMAP, "score": ADVANTAGE_CMAP, "entropy": ENTROPY_CMAP}.get(self.mode)

    @classmethod
    def fit(cls, mode: str, values: Sequence[np.ndarray], vmax: float | None = None) -> ColorScale:
        """Scale over all rendered values (so colours compare across responses); ``vmax`` overrides it."""
        if mode not in COLOR_MODES:
            raise ValueError(f"color={mode!r}: expected one of {COLOR_MODES}")
        if vmax is not None and not (vmax > 0 and math.isfinite(vmax)):
            raise ValueError(f"vmax={vmax}: must be a positive finite number")
        flat = np.concatenate([np.asarray(v, dtype=np.float64) for v in values]) if values else np.zeros(0)
        flat = flat[np.isfinite(flat)]
        if mode == "entropy":
            top = vmax if vmax is not None else (float(flat.max()) if flat.size else 0.0)
            return cls(mode, 0.0, top if top > 0 else 1.0)
        top = vmax if vmax is not None else (float(np.abs(flat).max()) if flat.size else 0.0)
        top = top if top > 0 else 1.0  # all zeros: any scale draws white
        return cls(mode, -top, top)

    def normalize(self, values: np.ndarray) -> np.ndarray:
        """Values -> ``[0, 1]`` colormap positions (clipped); 0 maps to 0.5 on diverging scales."""
        v = np.asarray(values, dtype=np.float64)
        return np.clip((v - self.vmin) / (self.vmax - self.vmin), 0.0, 1.0)

    def rgba(self, values: np.ndarray) -> np.ndarray:
        """``[T]`` values -> ``[T, 4]`` RGBA floats; NaN (missing) and mode ``none`` -> white."""
        v = np.asarray(values, dtype=np.float64)
        out = np.ones((v.shape[0], 4))
        if self.cmap_name is None:
            return out
        from matplotlib import colormaps

        ok = np.isfinite(v)
        out[ok] = colormaps[self.cmap_name](self.normalize(v[ok]))
        return out


def _hex(rgba: np.ndarray) -> list[str]:
    rgb = np.clip(np.rint(np.asarray(rgba)[:, :3] * 255), 0, 255).astype(int)
    return [f"#{r:02x}{g:02x}{b:02x}" for r, g, b in rgb]


def _text_is_dark(rgba: np.ndarray) -> np.ndarray:
    """Dark text on light boxes (relative luminance > 0.5)."""
    lum = 0.2126 * rgba[:, 0] + 0.7152 * rgba[:, 1] + 0.0722 * rgba[:, 2]
    return lum > 0.5


def _values(resp: Response, mode: str) -> np.ndarray | None:
    n = len(resp.tokens)
    if mode == "advantage":
        return resp.advantages
    if mode == "entropy":
        return resp.entropy
    if mode == "score":
        return None if resp.score is None else np.full(n, resp.score)
    return np.full(n, math.nan)


def _check_mode(responses: Sequence[Response], mode: str) -> None:
    if mode not in COLOR_MODES:
        raise ValueError(f"color={mode!r}: expected one of {COLOR_MODES}")
    field = {"advantage": "advantages", "entropy": "entropy", "score": "score"}.get(mode)
    for r in responses:
        if field is not None and _values(r, mode) is None:
            raise ValueError(
                f"color={mode}: response {r.key or r.uid} has no '{field}' (verl's rollout dumps are text only: "
                "use --color score or --color none, or write token dumps with gtpo.viz.tokens.token_records)"
            )


# --------------------------------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------------------------------


def _columns(group: list[Response]) -> list[tuple[str, list[Response]]]:
    cols = [
        ("correct", [r for r in group if r.correct is True]),
        ("incorrect", [r for r in group if r.correct is False]),
    ]
    ungraded = [r for r in group if r.correct is None]
    if ungraded:
        cols.append(("ungraded", ungraded))
    return cols


def _group(responses: Sequence[Response], max_prompts: int | None) -> list[list[Response]]:
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts={max_prompts}: must be >= 1 or None")
    groups: dict[str, list[Response]] = {}
    for r in responses:
        groups.setdefault(r.uid, []).append(r)
    return list(groups.values())[:max_prompts]


def _mode_label(mode: str) -> str:
    return {"advantage": "advantage", "entropy": "entropy", "score": "score", "none": "token"}[mode]


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else repr(float(v))


def _meta(r: Response) -> str:
    parts = [f"{len(r.tokens)} tokens"]
    if r.score is not None:
        parts.append(f"score={r.score:g}")
    if r.acc is not None:
        parts.append(f"acc={r.acc}")
    if r.advantages is not None and len(r.advantages):
        parts.append(f"mean adv={np.nanmean(r.advantages):+.4g}")
    if r.entropy is not None and len(r.entropy):
        parts.append(f"mean H={np.nanmean(r.entropy):.4g}")
    if r.key:
        parts.append(r.key)
    return " · ".join(parts)


# --------------------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:16px;color:#222;background:#fff}
h1{font-size:18px} h2{font-size:15px;margin:18px 0 4px} h3{font-size:13px;margin:4px 0}
.legend{display:flex;align-items:center;gap:8px;font-size:12px;margin:8px 0 16px}
.bar{width:320px;height:14px;border:1px solid #999}
.prompt{white-space:pre-wrap;background:#f6f6f6;border:1px solid #ddd;padding:6px;font-size:12px;max-height:12em;
overflow:auto}
.cols{display:grid;grid-template-columns:repeat(var(--ncols),minmax(0,1fr));gap:12px}
.col{min-width:0} .resp{border:1px solid #ccc;border-radius:4px;padding:6px;margin:6px 0}
.meta{font-size:11px;color:#555;margin-bottom:4px;word-break:break-all}
.toks{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;line-height:1.7;white-space:pre-wrap;
word-break:break-word}
.tok{box-shadow:inset 0 0 0 1px rgba(0,0,0,.10);border-radius:2px;padding:1px 0}
.tok:empty{padding:1px 1px}
"""


def _visible(tok: str) -> str:
    """Escaped display text: newline -> '↵' + line break, tab -> '⇥', spaces of whitespace-only tokens -> '·'."""
    shown = tok
    if tok and tok.strip() == "":
        shown = shown.replace(" ", "·")
    shown = html.escape(shown, quote=True).replace("\t", "⇥").replace("\r", "␍").replace("\n", "↵\n")
    return shown


def _attr(s: str) -> str:
    # Newlines and tabs as character references so attribute values survive any parser unchanged.
    return html.escape(s, quote=True).replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;")


def _legend_html(scale: ColorScale) -> str:
    if scale.cmap_name is None:
        return '<div class="legend">colour: none</div>'
    stops = np.linspace(scale.vmin, scale.vmax, 11)
    cols = _hex(scale.rgba(stops))
    grad = ", ".join(f"{c} {i * 10}%" for i, c in enumerate(cols))
    mid = "0" if scale.mode != "entropy" else f"{(scale.vmin + scale.vmax) / 2:.4g}"
    return (
        f'<div class="legend"><span>{_mode_label(scale.mode)}</span><span>{scale.vmin:.4g}</span>'
        f'<span class="bar" style="background:linear-gradient(to right, {grad})" '
        f'data-vmin="{scale.vmin!r}" data-vmax="{scale.vmax!r}" data-cmap="{scale.cmap_name}"></span>'
        f"<span>{scale.vmax:.4g}</span><span>(centre {mid}; colormap {scale.cmap_name})</span></div>"
    )


def _response_html(r: Response, mode: str, scale: ColorScale) -> str:
    vals = _values(r, mode)
    rgba = scale.rgba(vals)
    bgs = _hex(rgba)
    dark = _text_is_dark(rgba)
    label = _mode_label(mode)
    spans = []
    for i, tok in enumerate(r.tokens):
        title = f"{label}={_fmt(vals[i])}" if mode != "none" else f"token #{i}"
        if mode != "none":
            title += f"\n#{i}"
        if r.token_ids is not None:
            title += f" id={r.token_ids[i]}"
        if mode != "entropy" and r.entropy is not None:
            title += f"\nentropy={_fmt(r.entropy[i])}"
        if mode != "advantage" and r.advantages is not None:
            title += f"\nadvantage={_fmt(r.advantages[i])}"
        fg = "#000" if dark[i] else "#fff"
        spans.append(
            f'<span class="tok" data-i="{i}" data-tok="{_attr(tok)}" data-v="{_fmt(vals[i])}" '
            f'title="{_attr(title)}" style="background:{bgs[i]};color:{fg}">{_visible(tok)}</span>'
        )
    return (
        f'<div class="resp" data-uid="{_attr(r.uid)}" data-key="{_attr(r.key or "")}">'
        f'<div class="meta">{html.escape(_meta(r))}</div><div class="toks">{"".join(spans)}</div></div>'
    )


def render_html(
    responses: Sequence[Response],
    out_path: str | Path,
    *,
    color: str = "advantage",
    max_prompts: int | None = None,
    vmax: float | None = None,
    title: str = "Token heatmap",
) -> Path:
    """Write the self-contained HTML page; returns its path. Groups by uid, columns correct | incorrect."""
    groups = _group(responses, max_prompts)
    shown = [r for g in groups for r in g]
    _check_mode(shown, color)
    scale = ColorScale.fit(color, [_values(r, color) for r in shown] if color != "none" else [], vmax)
    parts = [
        '<!DOCTYPE html><html><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _legend_html(scale),
    ]
    for g in groups:
        cols = _columns(g)
        step = g[0].step
        head = f"prompt {g[0].uid}" + (f" · step {step}" if step is not None else "") + f" · {len(g)} responses"
        parts.append(f'<section class="group" data-uid="{_attr(g[0].uid)}"><h2>{html.escape(head)}</h2>')
        if g[0].prompt is not None:
            parts.append(f'<div class="prompt">{html.escape(g[0].prompt)}</div>')
        parts.append(f'<div class="cols" style="--ncols:{len(cols)}">')
        for name, rs in cols:
            parts.append(f'<div class="col {name}"><h3>{name} ({len(rs)})</h3>')
            parts.extend(_response_html(r, color, scale) for r in rs)
            parts.append("</div>")
        parts.append("</div></section>")
    parts.append("</body></html>\n")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(parts), encoding="utf-8")
    return out_path


# --------------------------------------------------------------------------------------------------------------
# PNG
# --------------------------------------------------------------------------------------------------------------


@functools.cache
def _mono_charmap() -> frozenset[int]:
    """Code points the monospace font draws itself (others fall back to fonts of another width)."""
    from matplotlib import font_manager, ft2font

    return frozenset(ft2font.FT2Font(font_manager.findfont(_MONO_FONT)).get_charmap())


def _cells(text: str) -> tuple[int, bool]:
    """Layout width of ``text`` in monospace cells (wide East Asian characters take 2) and whether every
    character is drawn by the monospace font at one cell (then it can join a line's single text run)."""
    charmap = _mono_charmap()
    width, mono = 0, True
    for ch in text:
        wide = unicodedata.east_asian_width(ch) in ("W", "F")
        width += 2 if wide else 1
        mono = mono and not wide and ord(ch) in charmap
    return width, mono


def _layout_response(tokens: Sequence[str], width: int) -> list[list[tuple[int, str, int, int, bool]]]:
    """Wrap tokens into lines of ``width`` cells.

    Returns lines of ``(token index, display text, x, cells, mono)``; empty tokens (the tail of a merged UTF-8
    span) take no cells and are left out.
    """
    lines: list[list[tuple[int, str, int, int, bool]]] = [[]]
    x = 0
    for i, tok in enumerate(tokens):
        newline = "\n" in tok
        shown = tok.replace("\r", "").replace("\t", "⇥").replace("\n", "↵")
        if shown.strip() == "" and shown:
            shown = shown.replace(" ", "·")
        # A token longer than a line is cut (the HTML keeps it whole).
        shown = shown[: width // 2] if len(shown) > width // 2 else shown
        if shown:
            w, mono = _cells(shown)
            if x + w > width and x > 0:
                lines.append([])
                x = 0
            lines[-1].append((i, shown, x, w, mono))
            x += w
        if newline:
            lines.append([])
            x = 0
    if not lines[-1] and len(lines) > 1:
        lines.pop()
    return lines


def render_png(
    responses: Sequence[Response],
    out_path: str | Path,
    *,
    color: str = "advantage",
    max_prompts: int | None = None,
    vmax: float | None = None,
    title: str = "Token heatmap",
    width_chars: int = 72,
    png_max_responses: int = 3,
    png_max_tokens: int = 300,
    fontsize: float = 7.0,
    dpi: int = 110,
    max_lines: int = 3000,
) -> Path:
    """Draw the overview PNG (matplotlib Agg, no pyplot state); returns its path."""
    from matplotlib import colormaps, rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.collections import PatchCollection
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    if width_chars < 8:
        raise ValueError(f"width_chars={width_chars}: must be >= 8")
    groups = _group(responses, max_prompts)
    shown_all = [r for g in groups for r in g]
    _check_mode(shown_all, color)
    # Same scale as the HTML: fitted on every response of the shown groups, not only the ones drawn here.
    scale = ColorScale.fit(color, [_values(r, color) for r in shown_all] if color != "none" else [], vmax)

    gap = 4
    # Rows of draw commands in layout units: x in characters, y in lines (0 at the top).
    rects: list[tuple[float, float, float, str]] = []  # x, y, w, colour hex
    texts: list[tuple[float, float, str, str, str]] = []  # x, y, text, colour, weight
    y = 3  # title + legend
    truncated = False
    ncols_max = 1
    for g in groups:
        cols = _columns(g)
        ncols_max = max(ncols_max, len(cols))
        head = f"prompt {g[0].uid}" + (f" · step {g[0].step}" if g[0].step is not None else "")
        if g[0].prompt:
            first = " ".join(g[0].prompt.split())
            head += " · " + (first[:width_chars] + "…" if len(first) > width_chars else first)
        texts.append((0, y, head, "#000", "bold"))
        y += 1
        bottoms = []
        for c, (name, rs) in enumerate(cols):
            x0 = c * (width_chars + gap)
            cy = y
            texts.append((x0, cy, f"{name} ({len(rs)})", "#333", "bold"))
            cy += 1
            for r in rs[:png_max_responses]:
                texts.append((x0, cy, _meta(r)[:width_chars], "#555", "normal"))
                cy += 1
                toks = r.tokens[:png_max_tokens]
                vals = _values(r, color)
                rgba = scale.rgba(vals[: len(toks)])
                bgs, dark = _hex(rgba), _text_is_dark(rgba)
                for line in _layout_response(toks, width_chars):
                    run = []
                    for i, shown, x, w, mono in line:
                        rects.append((x0 + x, cy, w, bgs[i]))
                        # One text run per line keeps the PNG fast; a token joins it only when it is dark text
                        # in one-cell monospace glyphs, else it is drawn on its own and the run keeps its cells.
                        if mono and dark[i]:
                            run.append(shown)
                        else:
                            run.append(" " * w)
                            texts.append((x0 + x, cy, shown, "#000" if dark[i] else "#fff", "normal"))
                    if line and "".join(run).strip():
                        texts.append((x0 + line[0][2], cy, "".join(run), "#000", "normal"))
                    cy += 1
                if len(r.tokens) > png_max_tokens:
                    texts.append((x0, cy, f"… {len(r.tokens) - png_max_tokens} more tokens", "#888", "normal"))
                    cy += 1
                cy += 0.5
            if len(rs) > png_max_responses:
                texts.append((x0, cy, f"… {len(rs) - png_max_responses} more responses", "#888", "normal"))
                cy += 1
            bottoms.append(cy)
        y = max(bottoms) + 1
        if y > max_lines:
            truncated = True
            break
    if truncated:
        texts.append((0, y, "… more prompts in the HTML", "#888", "normal"))
        y += 1

    # Unhinted glyphs advance by exactly 0.602 em, so text runs line up with the cell-sized boxes
    # (hinting rounds each advance to whole pixels and drifts by several cells per line).
    with rc_context({"text.hinting": "no_hinting"}):
        total_w = ncols_max * width_chars + (ncols_max - 1) * gap
        char_in = _MONO_ADVANCE_EM * fontsize / 72.0
        line_in = 1.45 * fontsize / 72.0
        fig = Figure(figsize=(total_w * char_in + 0.4, y * line_in + 0.3), dpi=dpi)
        FigureCanvasAgg(fig)
        fw, fh = fig.get_size_inches()
        ax = fig.add_axes((0.2 / fw, 0.15 / fh, total_w * char_in / fw, y * line_in / fh))
        ax.set_xlim(0, total_w)
        ax.set_ylim(y, 0)
        ax.axis("off")
        if rects:
            patches = [Rectangle((x, yy + 0.08), w, 0.84) for x, yy, w, _ in rects]
            coll = PatchCollection(patches, facecolors=[c for *_, c in rects], edgecolors="#00000022", linewidths=0.3)
            ax.add_collection(coll)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Glyph .* missing from font")
            ax.text(0, 0.5, title, fontsize=fontsize + 2, fontweight="bold", va="center", parse_math=False)
            for x, yy, s, c, weight in texts:
                ax.text(
                    x,
                    yy + 0.5,
                    s,
                    fontsize=fontsize,
                    family=_MONO_FONT,
                    color=c,
                    fontweight=weight,
                    va="center",
                    ha="left",
                    parse_math=False,
                    clip_on=False,
                )
            if scale.cmap_name is not None:
                # Colour legend: a horizontal colorbar in the header band.
                cax = fig.add_axes(
                    (
                        0.2 / fw + 0.35 * total_w * char_in / fw,
                        1 - (2.6 * line_in + 0.15) / fh,
                        min(3.0, 0.5 * total_w * char_in) / fw,
                        0.7 * line_in / fh,
                    )
                )
                sm = ScalarMappable(norm=Normalize(scale.vmin, scale.vmax), cmap=colormaps[scale.cmap_name])
                cb = fig.colorbar(sm, cax=cax, orientation="horizontal")
                cb.ax.tick_params(labelsize=fontsize - 1, length=2, pad=1)
                cb.ax.set_title(_mode_label(scale.mode), fontsize=fontsize, loc="left", pad=2)
            out_path = Path(out_path)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out_path, format="png", dpi=dpi, facecolor="white")
    return out_path


# --------------------------------------------------------------------------------------------------------------
# One call for the CLI
# --------------------------------------------------------------------------------------------------------------


def render_tokens(
    input_path: str | Path,
    out_dir: str | Path,
    *,
    color: str = "advantage",
    tokenizer: Any = None,
    max_prompts: int | None = 16,
    step: int | None = None,
    vmax: float | None = None,
    correct_threshold: float = 0.0,
    png: bool = True,
) -> dict[str, Any]:
    """Load a dump (file or rollout_data_dir) and write ``<stem>.<color>.html`` (+ ``.png``) into ``out_dir``.

    ``tokenizer`` is a tokenizer object or a local path for ``transformers.AutoTokenizer`` (only used to split
    verl's text dumps into tokens). Returns ``{"html", "png", "input", "n_prompts", "n_responses", "scale"}``.
    """
    src = find_dump(input_path, step)
    if isinstance(tokenizer, str | Path):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    responses = load_responses(src, tokenizer=tokenizer, correct_threshold=correct_threshold)
    groups = _group(responses, max_prompts)
    shown = [r for g in groups for r in g]
    out_dir = Path(out_dir)
    title = f"Token {_mode_label(color)} · {src.name}"
    html_path = render_html(
        responses, out_dir / f"{src.stem}.{color}.html", color=color, max_prompts=max_prompts, vmax=vmax, title=title
    )
    png_path = None
    if png:
        png_path = render_png(
            responses, out_dir / f"{src.stem}.{color}.png", color=color, max_prompts=max_prompts, vmax=vmax, title=title
        )
    scale = ColorScale.fit(color, [_values(r, color) for r in shown] if color != "none" else [], vmax)
    return {
        "html": html_path,
        "png": png_path,
        "input": src,
        "n_prompts": len(groups),
        "n_responses": len(shown),
        "scale": scale,
    }
