"""Reading one knob block: a config node into its frozen dataclass, every error naming the key.

Each block under ``algorithm.*`` has a frozen dataclass whose ``__post_init__`` raises ``ValueError("<field>=<value>:
<why>")`` through the checks below; :func:`load_knobs` prefixes the block's path, so a bad value fails at startup as
``algorithm.gtpo.alpha2=-1: must be >= 0`` before Ray or any GPU is touched. Which dataclass reads which block is the
registry of :mod:`gtpo.methods` (``KNOBS``, ``knob()``); this module imports nothing of the recipe.

The estimators' blocks are defined beside their equations (``gtpo.algorithms.*``); the trainer's own blocks are here:
``algorithm.groups`` (:class:`GroupParams`), ``algorithm.watchdog`` (:class:`WatchdogParams`),
``algorithm.preemption`` (:class:`PreemptionParams`), ``algorithm.resume`` (:class:`ResumeParams`) and
``algorithm.hardware`` (:class:`HardwareParams`, the GPUs the launch checks size a run for).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import signal
from collections.abc import Mapping
from numbers import Real
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "GroupParams",
    "HardwareParams",
    "PreemptionParams",
    "ResumeParams",
    "WatchdogParams",
    "check_choice",
    "check_flag",
    "check_real",
    "check_seconds",
    "load_knobs",
    "parse_deadline",
]

# Signals a process cannot handle, and those the driver needs as they are (Ctrl-C, its children, closed pipes).
UNHANDLEABLE = frozenset({"SIGKILL", "SIGSTOP", "SIGINT", "SIGCHLD", "SIGPIPE"})
# What a resume does with a checkpoint saved at another world size than the run's.
RESUME_POLICIES = ("reshard", "refuse")


def load_knobs(cls: type[T], node: Any, prefix: str) -> T:
    """Build the frozen dataclass ``cls`` from ``node``; unknown keys and invalid values raise with the key named.

    Args:
        cls: a dataclass type whose ``__post_init__`` validates its fields.
        node: a plain mapping or None (None means all defaults); :func:`gtpo.methods.knob` resolves a config node.
        prefix: the config path of the block, e.g. ``"algorithm.gtpo"``, used in error messages.
    """
    values = {} if node is None else dict(node) if isinstance(node, Mapping) else node
    if not isinstance(values, Mapping):
        raise ValueError(f"{prefix} must be a mapping of knobs, got {type(values).__name__}: {values!r}")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)}; valid keys: {sorted(names)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{prefix}.{err}") from None


def check_real(name: str, value, *, lo: float | None = None, lo_open: bool = False, hi: float | None = None) -> None:
    """A finite real number (not a bool) in ``[lo, hi)`` (``(lo, hi)`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name}={value!r}: must be a finite real number")
    v = float(value)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name}={value!r}: must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v >= hi:
        raise ValueError(f"{name}={value!r}: must be < {hi}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: must be one of {list(choices)}")


def check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false")


def check_seconds(name: str, value, *, zero_means: str | None = None) -> None:
    """A number of seconds ``>= 0`` (``zero_means`` says what 0 does, in the message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == math.inf:
        tail = f" ({zero_means})" if zero_means else ""
        raise ValueError(f"{name}={value!r}: must be a number of seconds >= 0{tail}")


def parse_deadline(value) -> str | float | None:
    """``"auto"``, None (no deadline) or a Unix time in seconds; an ISO 8601 string (local time unless it names a
    zone) becomes a Unix time."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(f"deadline={value!r}: expected auto, none, a Unix time or an ISO 8601 time")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            try:
                seconds = dt.datetime.fromisoformat(str(value).strip()).timestamp()
            except ValueError:
                raise ValueError(
                    f"deadline={value!r}: expected auto, none, a Unix time or an ISO 8601 time (2026-12-02T18:00:00)"
                ) from None
    # 0 or "0" would stop the run at once (as would nan), where the user meant no deadline
    if not 0 < seconds < math.inf:
        raise ValueError(f"deadline={value!r}: a Unix time must be > 0 (none turns the deadline off)")
    return seconds


@dataclasses.dataclass(frozen=True)
class PreemptionParams:
    """``algorithm.preemption``."""

    signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM")
    deadline: str | float | int | None = "auto"
    margin_s: float = 60.0
    save_estimate_s: float = 300.0
    step_factor: float = 1.5

    def __post_init__(self):
        names = (self.signals,) if isinstance(self.signals, str) else tuple(self.signals or ())
        for name in names:
            if not isinstance(name, str) or name not in signal.Signals.__members__ or name in UNHANDLEABLE:
                allowed = sorted(set(signal.Signals.__members__) - UNHANDLEABLE)
                raise ValueError(f"signals={list(names)!r}: {name!r} is not a signal the driver can handle ({allowed})")
        object.__setattr__(self, "signals", names)
        parse_deadline(self.deadline)  # raises on a bad value
        for name in ("margin_s", "save_estimate_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}={value!r}: must be a number of seconds >= 0")
        factor = self.step_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < math.inf:
            raise ValueError(f"step_factor={factor!r}: must be a number >= 1 (it multiplies the longest step seen)")


@dataclasses.dataclass(frozen=True)
class ResumeParams:
    """``algorithm.resume``."""

    other_world_size: str = "reshard"
    # A checkpoint larger than this (GB, model and optimizer files) is resharded inside the job only when asked
    # (null: any size): the whole allocation would wait for it.
    reshard_in_job_max_gb: float | None = 150.0

    def __post_init__(self):
        if self.other_world_size not in RESUME_POLICIES:
            raise ValueError(f"other_world_size={self.other_world_size!r}: must be one of {list(RESUME_POLICIES)}")
        if self.reshard_in_job_max_gb is not None:
            check_real("reshard_in_job_max_gb", self.reshard_in_job_max_gb, lo=0.0, lo_open=True)


@dataclasses.dataclass(frozen=True)
class HardwareParams:
    """``algorithm.hardware``: the GPU memory (GiB, as ``nvidia-smi`` reports it) a run is sized for."""

    gpu_memory_gib: tuple[float, ...] = (80.0,)

    def __post_init__(self):
        cards = (self.gpu_memory_gib,) if isinstance(self.gpu_memory_gib, (int, float)) else self.gpu_memory_gib
        if isinstance(cards, str) or not cards:
            raise ValueError(f"gpu_memory_gib={self.gpu_memory_gib!r}: must be a list of GiB, e.g. [80] or [24, 48]")
        for card in cards:
            check_real("gpu_memory_gib", card, lo=1.0)
        object.__setattr__(self, "gpu_memory_gib", tuple(float(c) for c in cards))


@dataclasses.dataclass(frozen=True)
class GroupParams:
    """``algorithm.groups``."""

    refuse_short: bool = False

    def __post_init__(self):
        if not isinstance(self.refuse_short, bool):
            raise ValueError(f"refuse_short={self.refuse_short!r}: must be true or false")


@dataclasses.dataclass(frozen=True)
class WatchdogParams:
    """``algorithm.watchdog``: per-stage limits in seconds (0 = no limit)."""

    weight_sync_s: float = 1800.0
    generation_s: float = 1800.0
    grace_s: float = 60.0

    def __post_init__(self):
        for name in ("weight_sync_s", "generation_s", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name}={value!r}: must be a number of seconds >= 0 (0 turns the limit off)")
        if self.grace_s == 0:
            raise ValueError("grace_s=0: must be > 0 s (the time the trainer has to fail on its own)")
