"""The metric history across a resume: what each tracker of verl's ``Tracking`` holds after a run resumes at step N.

A run killed after its step-N checkpoint has logged steps past N that the resumed run trains and logs again (the
"dead timeline"). verl 0.9.1's trackers know nothing of it (``verl/utils/tracking.py``). The recipe decides, here,
once per run, with the ``Tracking`` verl builds in ``fit()`` (:meth:`MetricHistory.attach`, called from the trainer's
``on_validate_begin`` / ``on_train_begin``, whichever verl calls first, before anything is logged):

* ``file`` (``FileLogger``, which opens its path with ``"wb"``): the earlier log is kept (moved aside before verl
  truncates it, put back after) and rewritten to the steps <= N, one line per step in step order (lines a step was
  logged on twice are merged, the later value winning); the dead timeline's steps go. A record the resumed run logs
  at step N itself (verl's validation before training) is merged into step N's line. So the file holds every step
  once, in order, as pandas or any JSONL reader sees it. Each rewrite goes to a temporary file that replaces the
  log (``os.replace``); a kill at any point leaves the history whole in the log or in its aside copy
  (``<log>.before-resume``), which the next start picks up.
* ``tensorboard`` (``_TensorboardAdapter``): its ``SummaryWriter`` is reopened on the same folder with
  ``purge_step=N+1``, so TensorBoard hides the dead timeline's events at steps > N (a ``SessionLog.START`` that its
  readers honour). A validation before training at step N adds its values at step N: TensorBoard's fast loader
  keeps the later value of a tag logged twice at one step, the legacy loader (``--load_fast=false``) shows both.
* ``wandb``: nothing can be done from here. verl calls ``wandb.init(project, name, entity, config)`` with no run id,
  so each start is a new W&B run under the same name; the dead attempt's run keeps its steps past N. W&B's history
  of one run only grows (a lower step is dropped with a warning), so attaching to the old run would keep the dead
  values and drop the resumed ones; rewinding a run (``resume_from="<id>?_step=<N>"``) is a W&B preview feature.
* ``console``: prints what is logged, as always; the dead attempt's lines stay in its own job log.

What this touches of verl's trackers (``FileLogger.fp``, ``Tracking.logger``, ``_TensorboardAdapter.writer``) is
the seam ``tracker-internals`` of docs/architecture.md.

A fresh run (N = 0) is left as verl built it (verl empties the file log), and an aside copy of an earlier run's log
is removed: kept, it would be taken for this run's history at this run's first resume. A validation-only run
(``trainer.val_only=true``) trains nothing, so it rewinds nothing: a file log of its name is kept whole and its
validation appended, TensorBoard gets no purge. It must not share the name of the run it evaluates, which may still
be logging through an open descriptor to the file moved aside here: ``scripts/eval_checkpoint.sh`` names it
``<run>-eval-step<N>`` with folders of its own, and the driver refuses the run's name
(:func:`gtpo.launch.checks.check_evaluation_apart`).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import warnings
from collections.abc import Iterable

from gtpo.metric_log import parse_line

__all__ = ["ASIDE_SUFFIX", "MetricHistory", "file_logger_path", "rewrite_log", "uses_file_logger"]

# Suffix of the aside copy that holds the history while verl re-creates the log file.
ASIDE_SUFFIX = ".before-resume"

logger = logging.getLogger(__name__)


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


def _replace_atomically(path: str, payload: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rewrite_log(src: str, dst: str, last_step: int, serialize, extra: tuple[int, dict] | None = None) -> dict[int, int]:
    """Rewrite the log ``src`` into ``dst`` (atomically): the records of steps <= ``last_step``, one line per step.

    A step logged on one line keeps its line byte for byte; a step logged on several lines (and the step of
    ``extra``, a record merged in last) gets one merged line, a later value replacing an earlier one, written by
    ``serialize(data, step) -> bytes``. A partial last line (a kill in the middle of a write) is dropped; any other
    line that is not a record is dropped with a warning naming it.

    Returns:
        ``{step: lines merged}`` of the steps kept.
    """
    with open(src, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    partial = lines.pop()  # b"" when the file ends with a newline
    if partial:
        logger.warning("%s: dropping a partial last line (%d bytes)", src, len(partial))
    by_step: dict[int, list[tuple[bytes, dict]]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        parsed = parse_line(line)
        if isinstance(parsed, str):
            logger.warning("%s:%d: dropped from the history (%s)", src, i + 1, parsed)
            continue
        step, data = parsed
        if step <= last_step:
            by_step.setdefault(step, []).append((line, data))
    if extra is not None:
        by_step.setdefault(extra[0], []).append((b"", extra[1]))
    out = []
    for step in sorted(by_step):
        records = by_step[step]
        if len(records) == 1 and records[0][0]:
            out.append(records[0][0] + b"\n")
            continue
        merged: dict = {}
        for _, data in records:
            merged.update(data)
        out.append(serialize(merged, step))
    _replace_atomically(dst, b"".join(out))
    return {step: len(records) for step, records in by_step.items()}


def _serialize_like(file_logger):
    """``serialize(data, step) -> bytes``: the line verl's ``FileLogger.log`` writes (its own serialiser, run
    against a buffer), so a merged line is formatted as every other line."""

    def serialize(data: dict, step: int) -> bytes:
        fp, buffer = file_logger.fp, io.BytesIO()
        file_logger.fp = buffer
        try:
            file_logger.log(data=data, step=step)
        finally:
            file_logger.fp = fp
        return buffer.getvalue()

    return serialize


class _ResumedFileLogger:
    """verl's ``FileLogger`` after a resume at ``step``: a record logged at ``step`` before any later one merges into
    the log's line of that step (the log is rewritten); every other record is appended by verl's logger."""

    def __init__(self, inner, path: str, step: int):
        self._inner, self._path, self._merge_step = inner, path, step

    def log(self, data, step):
        if self._merge_step is not None and step == self._merge_step:
            self._inner.fp.close()
            rewrite_log(self._path, self._path, step, _serialize_like(self._inner), extra=(step, data))
            self._inner.fp = open(self._path, "ab", buffering=0)  # noqa: SIM115 - closed by verl's FileLogger.finish
            return
        self._merge_step = None
        self._inner.log(data=data, step=step)

    def finish(self):
        self._inner.finish()

    def __getattr__(self, name):
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


class MetricHistory:
    """The trackers' history of one run (see the module docstring).

    Use: build it in ``fit()`` before verl builds ``Tracking`` (it moves an existing file log aside), then
    :meth:`attach` the built ``Tracking`` before anything is logged.

    Args:
        resumed_step: the step the run resumed at (verl's ``global_steps`` after ``_load_checkpoint``); 0 for a
            fresh run.
        file_log: the path verl's ``FileLogger`` will write to, or None when ``trainer.logger`` has no ``file``.
        rewind: drop what was logged after ``resumed_step`` (a run that trains on from there); False keeps the
            whole history and appends (a validation-only run).
    """

    def __init__(self, resumed_step: int, file_log: str | None, rewind: bool = True):
        self.resumed_step = int(resumed_step)
        self.rewind = bool(rewind)
        self.path = os.path.abspath(file_log) if file_log else None
        self.aside = self.path + ASIDE_SUFFIX if self.path else None
        if self.resumed_step > 0 and self.path:
            self._set_aside()
        elif self.path and os.path.exists(self.aside):
            # A fresh run's history starts empty; an earlier run's aside copy would replace it at the first resume.
            logger.warning("%s: a fresh run, removing the earlier run's aside copy of the log", self.aside)
            os.remove(self.aside)

    @classmethod
    def for_trainer(cls, trainer_config, resumed_step: int) -> MetricHistory:
        """From the trainer's ``trainer`` config block (``logger``, ``project_name``, ``experiment_name``)."""
        path = None
        if uses_file_logger(trainer_config.get("logger", None)):
            path = file_logger_path(trainer_config.project_name, trainer_config.experiment_name)
        return cls(resumed_step, path, rewind=not trainer_config.get("val_only", False))

    def _set_aside(self) -> None:
        """Move the existing log out of verl's way (an aside copy left by a killed attempt is the history: kept)."""
        if os.path.exists(self.aside):
            return
        if os.path.exists(self.path):
            os.replace(self.path, self.aside)

    def attach(self, tracking) -> None:
        """Apply the history to verl's freshly built ``Tracking`` (its ``logger`` dict of backends)."""
        backends = getattr(tracking, "logger", None)
        if backends is None:
            return
        if self.resumed_step > 0 and self.path:
            self._attach_file(backends)
        if self.resumed_step > 0 and self.rewind and "tensorboard" in backends:
            self._attach_tensorboard(backends["tensorboard"])

    def _attach_file(self, backends: dict) -> None:
        file_logger = backends.get("file")
        if file_logger is None or os.path.abspath(file_logger.filepath) != self.path:
            if os.path.exists(self.aside) and not os.path.exists(self.path):
                os.replace(self.aside, self.path)
            if file_logger is not None:
                warnings.warn(
                    f"file logger writes to {file_logger.filepath}, not {self.path}: history not kept", stacklevel=3
                )
            return
        file_logger.fp.close()
        last_step = self.resumed_step if self.rewind else sys.maxsize
        if os.path.exists(self.aside):
            kept = rewrite_log(self.aside, self.path, last_step, _serialize_like(file_logger))
            os.remove(self.aside)
            if self.rewind:
                print(
                    f"gtpo: {self.path} keeps steps <= {self.resumed_step} ({len(kept)} records); "
                    "the steps logged after the checkpoint by the killed run are dropped"
                )
        file_logger.fp = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed by verl's FileLogger.finish
        if self.rewind:
            backends["file"] = _ResumedFileLogger(file_logger, self.path, self.resumed_step)

    def _attach_tensorboard(self, adapter) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = adapter.writer.log_dir
        adapter.writer.close()
        adapter.writer = SummaryWriter(log_dir, purge_step=self.resumed_step + 1)
        adapter.writer.flush()
