"""Which benchmark each validation prompt came from, stored beside verl's validation dump.

verl's ``trainer.validation_data_dir`` dump (``<step>.jsonl``) has no ``data_source`` field. The ``gtpo_sync``
trainer writes ``<step>.data_sources.json`` next to it ({prompt uid: data_source}); ``python -m gtpo.eval`` reads it
when it is there, so AIME 2024, AIME 2025 and MATH 500 of one validation come out as separate rows without
``--data``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SUFFIX", "read_data_sources", "sidecar_path", "write_data_sources"]

SUFFIX = ".data_sources.json"


def sidecar_path(dump: str | Path) -> Path:
    """``<dir>/<step>.data_sources.json`` for the dump ``<dir>/<step>.jsonl``."""
    dump = Path(dump)
    return dump.with_name(dump.name.split(".")[0] + SUFFIX)


def write_data_sources(val_data_dir: str | Path, step: int, uids: Sequence[str], data_sources: Sequence[str]) -> Path:
    """Write {prompt uid: data_source} of one validation; ValueError if a uid maps to two data sources."""
    if len(uids) != len(data_sources):
        raise ValueError(f"lengths differ: uids={len(uids)}, data_sources={len(data_sources)}")
    table: dict[str, str] = {}
    for uid, ds in zip(map(str, uids), map(str, data_sources), strict=True):
        if table.setdefault(uid, ds) != ds:
            raise ValueError(f"prompt uid {uid!r} has two data sources: {table[uid]!r} and {ds!r}")
    path = Path(val_data_dir) / f"{step}{SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, sort_keys=True))
    return path


def read_data_sources(dump: str | Path) -> dict[str, str]:
    """The {prompt uid: data_source} table beside ``dump``, or {} when there is none."""
    path = sidecar_path(dump)
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object {{uid: data_source}}")
    return {str(k): str(v) for k, v in table.items()}
