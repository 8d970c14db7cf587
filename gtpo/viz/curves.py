"""Training curves from metric logs: reward, entropy, response length and validation accuracy against step.

Reads the JSONL written by verl's ``file`` logger (``verl/utils/tracking.py::FileLogger``; enable it with
``trainer.logger='["console","file"]'``). Each line is ``{"step": <int>, "data": {<metric key>: <value>, ...}}``; the
file is ``$VERL_FILE_LOGGER_PATH`` if set, else ``${VERL_FILE_LOGGER_ROOT:-.}/<project_name>/<experiment_name>.jsonl``
(relative to the trainer's working directory). Plain JSONL lines ``{"step": <int>, "<key>": <value>, ...}`` work too.

Default panels (a 2×2 grid, runs overlaid, one colour per run):

* reward: ``critic/score/mean``
* entropy: ``actor/entropy``
* response length: ``response_length/mean``
* validation accuracy: every ``val-core/*/acc/mean@*`` key (one line per data source and run)

``--metrics`` replaces them with any keys or ``fnmatch`` patterns. A panel whose metric no run logged says so
instead of failing.

Deliberate choices
------------------
* Several lines may share a step (verl logs validation-before-training as its own line; the training line of the
  same step comes later): values merge per key, and a later line wins for a key logged twice at one step.
* ``null`` values (orjson writes NaN/inf as null) and non-numeric values (lists, strings) are not points; they
  are left out of the series. A malformed *last* line (a run still writing) is skipped with a warning; a malformed
  line anywhere else is an error.
* ``--smooth a`` draws an exponential moving average (weight ``a`` on the past) over the raw curve drawn faintly,
  for series of more than 20 points (sparse validation curves stay raw); the returned series are always the raw
  logged values.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from pathlib import Path

from gtpo.verl_plugin.file_log import read_file_log

__all__ = ["DEFAULT_PANELS", "load_metrics", "parse_run_spec", "plot_curves"]

# (panel title, key or fnmatch pattern)
DEFAULT_PANELS: tuple[tuple[str, str], ...] = (
    ("reward (critic/score/mean)", "critic/score/mean"),
    ("entropy (actor/entropy)", "actor/entropy"),
    ("response length (response_length/mean)", "response_length/mean"),
    ("validation accuracy (val-core/*/acc/mean@*)", "val-core/*/acc/mean@*"),
)

Series = tuple[list[int], list[float]]
_MIN_POINTS_TO_SMOOTH = 20


def _number(v: object) -> float | None:
    if isinstance(v, bool) or v is None:
        return None if v is None else float(v)
    if isinstance(v, int | float):
        return float(v) if math.isfinite(float(v)) else None
    return None


def load_metrics(path: str | Path) -> dict[str, Series]:
    """Read one run's metric log into ``{key: (steps, values)}``, steps ascending, one value per step.

    Accepts verl's file-logger lines ``{"step", "data": {...}}`` and plain ``{"step", key: value}`` lines.
    """
    table: dict[str, dict[int, float]] = {}
    for step, data in read_file_log(path):  # one merged record per step; a resumed run's repeat wins
        for key, value in data.items():
            num = _number(value)
            if num is not None:
                table.setdefault(key, {})[step] = num
    out: dict[str, Series] = {}
    for key, by_step in table.items():
        steps = sorted(by_step)
        out[key] = (steps, [by_step[s] for s in steps])
    return out


def parse_run_spec(spec: str) -> tuple[str, Path]:
    """``NAME=path`` -> (NAME, path); a bare path is named after its file stem."""
    name, sep, path = spec.partition("=")
    if not sep:
        return Path(spec).stem, Path(spec)
    if not name or not path:
        raise ValueError(f"--run {spec!r}: expected NAME=path/to/metrics.jsonl")
    return name, Path(path)


def _ema(values: Sequence[float], weight: float) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else weight * acc + (1 - weight) * v
        out.append(acc)
    return out


def _match(keys: Sequence[str], pattern: str) -> list[str]:
    if any(ch in pattern for ch in "*?["):
        return sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern))
    return [pattern] if pattern in keys else []


def plot_curves(
    runs: Sequence[tuple[str, str | Path]] | dict[str, str | Path],
    out_path: str | Path,
    *,
    metrics: Sequence[str] | None = None,
    smooth: float = 0.0,
    title: str | None = None,
    dpi: int = 120,
) -> dict[str, dict[str, Series]]:
    """Plot runs overlaid into one PNG grid (two columns).

    Args:
        runs: ``[(name, metrics.jsonl), ...]`` or ``{name: path}``; names must be unique.
        out_path: PNG path (parent folders are created).
        metrics: keys or fnmatch patterns, one panel each; default :data:`DEFAULT_PANELS`.
        smooth: EMA weight in ``[0, 1)`` for the drawn line (0 = raw).
        title: figure title.
        dpi: PNG resolution.

    Returns:
        ``{run name: {metric key: (steps, values)}}`` for exactly the series drawn (raw values).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pairs = list(runs.items()) if isinstance(runs, dict) else [tuple(r) for r in runs]
    if not pairs:
        raise ValueError("no runs given")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth={smooth}: must be in [0, 1)")
    panels = list(DEFAULT_PANELS) if metrics is None else [(m, m) for m in metrics]
    if not panels:
        raise ValueError("metrics: empty list")
    logs = {name: load_metrics(path) for name, path in pairs}

    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6.0 * ncols, 3.6 * nrows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colours = [f"C{i % 10}" for i in range(len(pairs))]
    plotted: dict[str, dict[str, Series]] = {}
    styles = ["-", "--", ":", "-."]
    for ax, (panel_title, pattern) in zip(axes, panels, strict=False):
        ax.set_title(panel_title, fontsize=10)
        # Colour = run, line style = metric key (same key, same style in every run).
        panel_keys = sorted(_match_all(logs, pattern))
        drawn = 0
        for (name, _), colour in zip(pairs, colours, strict=True):
            for key in _match(list(logs[name]), pattern):
                steps, values = logs[name][key]
                if not steps:
                    continue
                label = name if len(panel_keys) == 1 else f"{name}: {key}"
                style = {"color": colour, "linestyle": styles[panel_keys.index(key) % len(styles)]}
                # Sparse series (validation every k steps) are drawn raw: an EMA over a handful of points lags.
                if smooth > 0 and len(steps) > _MIN_POINTS_TO_SMOOTH:
                    ax.plot(steps, values, alpha=0.25, linewidth=0.8, **style)
                    ax.plot(steps, _ema(values, smooth), label=label, linewidth=1.4, **style)
                else:
                    marker = "o" if len(steps) <= 30 else None
                    ax.plot(steps, values, label=label, marker=marker, markersize=3, linewidth=1.4, **style)
                plotted.setdefault(name, {})[key] = (list(steps), list(values))
                drawn += 1
        if drawn == 0:
            ax.text(
                0.5,
                0.5,
                f"no '{pattern}' in any run",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
                color="#888",
                parse_math=False,
            )
            ax.set_xticks([])
            ax.set_yticks([])
        else:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=dpi, facecolor="white")
    return plotted


def _match_all(logs: dict[str, dict[str, Series]], pattern: str) -> set[str]:
    """Keys matching ``pattern`` in any run: a panel with one key labels lines by run name only."""
    return {k for log in logs.values() for k in _match(list(log), pattern)}
