"""verl's ``file`` logger across a resume: keep the earlier records, and read a log one record per step.

verl 0.9.1's ``FileLogger`` (``verl/utils/tracking.py``) opens its path with ``"wb"``, so a resumed run truncates
the metric history of the steps before the crash. :class:`FileLogHistory` keeps it without touching verl's class:
before the trainer builds its ``Tracking`` the existing log is renamed aside, and once verl has opened (and
emptied) the path, the kept file is renamed back over it and the logger's handle reopened in append mode. A kill
at any point leaves the history in one of the two files, and the next resume picks it up from the aside copy. A
partial last line (a kill in the middle of a write) is dropped before appending.

A resumed run logs again the steps after its last checkpoint (and its validation before training at the
checkpoint's step). :func:`read_file_log` is the one reader of such a log: records are merged per step in file
order and a key logged again for a step replaces the earlier value, so the later record wins and every step
appears once. ``python -m gtpo.viz curves`` and the CPU demo read logs through it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FileLogHistory", "file_logger_path", "read_file_log"]

# Suffix of the aside copy that holds the history while verl re-creates the log file.
ASIDE_SUFFIX = ".before-resume"


def file_logger_path(project_name: str, experiment_name: str) -> str:
    """The path verl's ``FileLogger`` writes to: ``VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root default ``.``), as an absolute path."""
    path = os.getenv("VERL_FILE_LOGGER_PATH", None)
    if path is None:
        root = os.path.expanduser(os.getenv("VERL_FILE_LOGGER_ROOT", "."))
        path = os.path.join(root, project_name, f"{experiment_name}.jsonl")
    return os.path.abspath(path)


def uses_file_logger(logger_config: str | Iterable[str] | None) -> bool:
    """Whether ``trainer.logger`` (a name or a list of names) includes verl's ``file`` backend."""
    if logger_config is None:
        return False
    names = [logger_config] if isinstance(logger_config, str) else list(logger_config)
    return "file" in names


def _drop_partial_last_line(path: str) -> None:
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class FileLogHistory:
    """Keeps a file-logger log across a resumed run (see the module docstring).

    Use: :meth:`set_aside` before verl builds ``Tracking``, :meth:`reattach` with the built ``Tracking`` right after.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.aside = self.path + ASIDE_SUFFIX

    def set_aside(self) -> None:
        """Move the existing log out of verl's way (an aside copy left by a killed attempt is kept as is)."""
        if os.path.exists(self.aside):
            return
        if os.path.exists(self.path):
            os.replace(self.path, self.aside)

    def reattach(self, tracking) -> None:
        """Put the history back under verl's freshly opened logger and make it append.

        ``tracking`` is verl's ``Tracking``; without a ``file`` backend, or with a logger writing elsewhere than
        :attr:`path`, the history is moved back untouched.
        """
        file_logger = getattr(tracking, "logger", {}).get("file")
        if file_logger is None or os.path.abspath(file_logger.filepath) != self.path:
            if os.path.exists(self.aside) and not os.path.exists(self.path):
                os.replace(self.aside, self.path)
            if file_logger is not None:
                warnings.warn(
                    f"file logger writes to {file_logger.filepath}, not {self.path}: history not kept", stacklevel=2
                )
            return
        file_logger.fp.close()
        if os.path.exists(self.aside):
            _drop_partial_last_line(self.aside)
            os.replace(self.aside, self.path)
        file_logger.fp = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed by verl's FileLogger.finish


def read_file_log(path: str | os.PathLike, *, strict: bool = True) -> list[tuple[int, dict]]:
    """``[(step, data)]``, steps ascending, one entry per step, from a file-logger JSONL.

    Lines are verl's ``{"step": s, "data": {...}}`` or plain ``{"step": s, key: value, ...}``. Records of the same
    step are merged in file order; a key logged again replaces the earlier value (the later record wins).

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
        where = f"{path}:{i + 1}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if not strict:
                continue
            if i == last:
                warnings.warn(f"{where}: skipping a truncated last line ({e.msg})", stacklevel=2)
                continue
            raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
        step = rec.get("step") if isinstance(rec, dict) else None
        if isinstance(step, bool) or not isinstance(step, int | float) or step != int(step):
            if not strict:
                continue
            if not isinstance(rec, dict) or "step" not in rec:
                raise ValueError(f"{where}: expected an object with a 'step' field")
            raise ValueError(f"{where}: step={step!r} is not an integer")
        data = rec["data"] if isinstance(rec.get("data"), dict) else {k: v for k, v in rec.items() if k != "step"}
        merged.setdefault(int(step), {}).update(data)
    return sorted(merged.items())
