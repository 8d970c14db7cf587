"""The offline asset cache shared by the tiny fixture and the CPU demo: one folder per recipe hash, built once.

A folder is built in a temporary sibling and renamed into place under a file lock, so concurrent callers
(pytest-xdist, Ray workers) are safe; ``RECIPE.json`` is written last and marks a complete build.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AssetPaths", "build_once", "default_cache_dir"]

COMPLETE_MARKER = "RECIPE.json"


@dataclass(frozen=True)
class AssetPaths:
    """Paths of a built asset folder (all absolute)."""

    model_dir: str
    tokenizer_dir: str
    train_parquet: str
    val_parquet: str

    @classmethod
    def of(cls, folder: Path) -> AssetPaths:
        return cls(
            model_dir=str(folder / "model"),
            tokenizer_dir=str(folder / "tokenizer"),
            train_parquet=str(folder / "data" / "train.parquet"),
            val_parquet=str(folder / "data" / "val.parquet"),
        )


def default_cache_dir() -> Path:
    return Path(os.environ.get("GTPO_CACHE_DIR") or Path.home() / ".cache" / "gtpo" / "tiny")


def build_once(cache_dir: str | os.PathLike | None, name: str, build_into: Callable[[Path], None]) -> AssetPaths:
    """``<cache_dir>/<name>``, built by ``build_into(folder)`` (which writes ``RECIPE.json`` last) if not there yet."""
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    if (final / COMPLETE_MARKER).is_file():
        return AssetPaths.of(final)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / COMPLETE_MARKER).is_file():
                return AssetPaths.of(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
            try:
                build_into(tmp)
                if final.exists():
                    # Left by an interrupted build (no RECIPE.json, so incomplete).
                    shutil.rmtree(final)
                os.rename(tmp, final)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return AssetPaths.of(final)
