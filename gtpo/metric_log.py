"""The metric log: verl's ``file`` logger JSONL, read one record per step (json only; no verl, no matplotlib).

verl 0.9.1's ``FileLogger`` (``verl/utils/tracking.py``) writes one line per ``Tracking.log`` call,
``{"step": <int>, "data": {<metric key>: <value>, ...}}``; plain lines ``{"step": <int>, <key>: <value>, ...}`` are
read too. The file is ``$VERL_FILE_LOGGER_PATH`` if set, else
``${VERL_FILE_LOGGER_ROOT:-.}/<project>/<experiment>.jsonl``.

This module sits below both its readers and its writer: ``gtpo.viz`` (curves), the CPU demo and
``gtpo.trainer.observe.metric_history`` (which rewrites the log after a resume) all parse lines here, and it imports
none of them.

Several lines may share a step: verl logs the validation before training as its own line, and a log written before
``metric_history`` existed repeats the steps a resumed run logged again. :func:`read_file_log` merges them, a key
logged again replacing the earlier value (the later record wins), so a reader sees every step once.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

__all__ = ["parse_line", "read_file_log"]


def parse_line(line: str | bytes) -> tuple[int, dict] | str:
    """``(step, data)`` of one JSONL line, or the reason it is not a record (a string).

    ``step`` must be an integer (``4.0`` counts as 4, ``True`` does not).
    """
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg})"
    if not isinstance(rec, dict) or "step" not in rec:
        return "expected an object with a 'step' field"
    step = rec["step"]
    if isinstance(step, bool) or not isinstance(step, int | float) or step != int(step):
        return f"step={step!r} is not an integer"
    data = rec["data"] if isinstance(rec.get("data"), dict) else {k: v for k, v in rec.items() if k != "step"}
    return int(step), data


def read_file_log(path: str | os.PathLike, *, strict: bool = True) -> list[tuple[int, dict]]:
    """``[(step, data)]``, steps ascending, one entry per step, from a file-logger JSONL.

    Records of the same step are merged in file order; a key logged again replaces the earlier value.

    Args:
        path: the JSONL file.
        strict: True: a bad line (invalid JSON, no integer ``step``) raises ``ValueError`` naming ``path:line``,
            except a truncated last line (a run still writing), which is skipped with a warning. False: every bad
            line is skipped silently (a live log read while training).

    Raises:
        ValueError: the file does not exist, or (strict) a bad line.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"metrics file {path}: not found")
    lines = path.read_text(encoding="utf-8").splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    merged: dict[int, dict] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        parsed = parse_line(line)
        if isinstance(parsed, str):
            if not strict:
                continue
            where = f"{path}:{i + 1}"
            if i == last and parsed.startswith("invalid JSON"):
                warnings.warn(f"{where}: skipping a truncated last line ({parsed})", stacklevel=2)
                continue
            raise ValueError(f"{where}: {parsed}")
        step, data = parsed
        merged.setdefault(step, {}).update(data)
    return sorted(merged.items())
