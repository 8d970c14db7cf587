"""Training curves from metric logs: reward, entropy, response length and validation accuracy against step.

Reads the JSONL written by verl's ``file`` logger (``verl/utils/tracking.py::FileLogger``; enable it with
``trainer.logger='["console","file"]'``). Each line is ``{"step": <int>, "data": {<metric key>: <value>, ...}}``; the
file is ``$VERL_FILE_LOGGER_PATH`` if set, else ``${VERL_FILE_LOGGER_ROOT:-.}/<project_name>/<experiment_name>.jsonl``
(relative to the trainer's working directory). Plain JSONL lines ``{"step": <int>, "<key>": <value>, ...}`` work too.

Default panels (a 2×2 grid, runs overlaid, one colour per run), titled in words by :data:`METRIC_TITLES` with the
metric key under each title:

* "mean reward": ``critic/score/mean``
* "policy entropy": ``actor/entropy``
* "response length": ``response_length/mean``
* "validation Mean@N": every ``val-core/*/acc/mean@*`` key (one line per data source and run)

``--metrics`` replaces them with any keys or ``fnmatch`` patterns (matched case-insensitively). A panel whose
metric no run logged says so instead of failing. Runs given under the same name are seeds of one method: they are
drawn as their mean with a min–max band, on the steps every seed logged.

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
import re
from collections.abc import Sequence
from pathlib import Path

from gtpo.metric_log import read_file_log

__all__ = ["DEFAULT_PANELS", "METRIC_TITLES", "load_metrics", "metric_title", "parse_run_spec", "plot_curves"]

# Default panels: metric keys or fnmatch patterns.
DEFAULT_PANELS: tuple[str, ...] = (
    "critic/score/mean",
    "actor/entropy",
    "response_length/mean",
    "val-core/*/acc/mean@*",
)

# Human titles: (regular expression over the whole key, case-insensitive; title, formatted with the named groups).
# A new metric name is one line here. ``source`` (the data source) labels the lines of a multi-source panel.
METRIC_TITLES: tuple[tuple[str, str], ...] = (
    (r"critic/score/mean", "mean reward"),
    (r"critic/rewards/mean", "mean reward (after penalties)"),
    (r"actor/entropy", "policy entropy"),
    (r"response_length/mean", "response length"),
    (r"actor/pg_loss", "policy loss"),
    (r"actor/grad_norm", "gradient norm"),
    (r"actor/ppo_kl", "KL to the old policy"),
    (r"training/num_turns/mean", "turns per response (verl: assistant + tool turns + 1)"),
    (r"(?P<source>gtpo|grpo_s|gtpo_traj)/tool_outputs_per_response", "tool outputs per response"),
    (r"(?P<source>gtpo|grpo_s|gtpo_traj)/masked_token_frac", "share of tool tokens in the responses"),
    (r"(?P<source>gtpo|grpo_s|gtpo_traj)/entropy_after_tool_mean", "entropy of the first token after a tool output"),
    (r"val-(?:core|aux)/(?P<source>[^/]+)/(?:acc|reward)/mean@(?P<n>\d+)", "validation Mean@{n}"),
    (r"val-(?:core|aux)/(?P<source>[^/]+)/(?:acc|reward)/pass@(?P<n>\d+)(?:/mean)?", "validation Pass@{n}"),
    (r"val-(?:core|aux)/(?P<source>[^/]+)/(?:acc|reward)/best@(?P<n>\d+)/mean", "validation best@{n} (verl bootstrap)"),
    (r"val-(?:core|aux)/(?P<source>[^/]+)/(?:acc|reward)/maj@(?P<n>\d+)/mean", "validation maj@{n}"),
)
_TITLE_RES = tuple((re.compile(rx, re.IGNORECASE), title) for rx, title in METRIC_TITLES)

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
        return sorted(k for k in keys if fnmatch.fnmatchcase(k.lower(), pattern.lower()))
    return [pattern] if pattern in keys else []


def metric_title(key: str) -> tuple[str, str | None]:
    """``(human title, data source)`` of a metric key by :data:`METRIC_TITLES`; the key itself when none fits."""
    for rx, title in _TITLE_RES:
        m = rx.fullmatch(key)
        if m:
            groups = m.groupdict()
            return title.format(**groups), groups.get("source")
    return key, None


def _panel_title(pattern: str, keys: Sequence[str]) -> str:
    titles = list(dict.fromkeys(metric_title(k)[0] for k in keys)) or [metric_title(pattern)[0]]
    return " / ".join(titles)


def _seed_stats(series: list[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max over seeds on the steps every seed logged."""
    common = sorted(set.intersection(*(set(steps) for steps, _ in series)))
    table = [dict(zip(steps, values, strict=True)) for steps, values in series]
    rows = [[t[s] for t in table] for s in common]
    return common, [sum(r) / len(r) for r in rows], [min(r) for r in rows], [max(r) for r in rows]


CROWDED_RUNS = 6  # more runs than this: one figure legend below the panels instead of one in each panel


def figure_legend(seed_counts: dict[str, int]) -> tuple[list[str], str | None]:
    """Labels and title of the shared legend of a crowded figure, from ``{run name: number of seeds}``: the seed
    count goes into the title when every run has the same one (> 1), else into each multi-seed label."""
    counts = set(seed_counts.values())
    if len(counts) == 1:
        count = counts.pop()
        return list(seed_counts), (f"mean of {count} seeds, band min–max" if count > 1 else None)
    labels = [f"{n} (mean of {c} seeds)" if c > 1 else n for n, c in seed_counts.items()]
    return labels, "band: min–max over seeds"


def run_colours(names: list[str]) -> dict[str, str | tuple[float, ...]]:
    """One colour per run: matplotlib's 10-colour cycle, or the 20 of ``tab20`` when there are more runs (a sweep
    of 11 configurations would otherwise draw two runs in one colour); beyond 20 colours repeat."""
    if len(names) <= 10:
        return {name: f"C{i}" for i, name in enumerate(names)}
    from matplotlib import colormaps

    palette = colormaps["tab20"].colors
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def plot_curves(
    runs: Sequence[tuple[str, str | Path]] | dict[str, str | Path],
    out_path: str | Path,
    *,
    metrics: Sequence[str] | None = None,
    smooth: float = 0.0,
    title: str | None = None,
    dpi: int = 120,
) -> dict[str, dict[str, Series]]:
    """Plot runs overlaid into one PNG grid.

    Args:
        runs: ``[(name, metrics.jsonl), ...]`` or ``{name: path}``. Runs sharing a name are seeds of one method,
            drawn as their mean with a min–max band.
        out_path: PNG path (parent folders are created).
        metrics: keys or fnmatch patterns, one panel each; default :data:`DEFAULT_PANELS`.
        smooth: EMA weight in ``[0, 1)`` for the drawn line (0 = raw).
        title: figure title.
        dpi: PNG resolution.

    Returns:
        ``{run name: {metric key: (steps, values)}}`` for exactly the series drawn: the raw logged values of a
        single run, the mean over seeds (on the steps all of them logged) of a group.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    pairs = list(runs.items()) if isinstance(runs, dict) else [tuple(r) for r in runs]
    if not pairs:
        raise ValueError("no runs given")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth={smooth}: must be in [0, 1)")
    panels = list(DEFAULT_PANELS) if metrics is None else list(metrics)
    if not panels:
        raise ValueError("metrics: empty list")
    paths = [Path(p) for _, p in pairs]
    if len(set(paths)) != len(paths):
        raise ValueError(f"the same metrics file is given twice: {[str(p) for p in paths]}")
    seeds: dict[str, list[dict[str, Series]]] = {}
    for name, path in pairs:
        seeds.setdefault(name, []).append(load_metrics(path))

    ncols = 2 if len(panels) in (2, 4) else min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.5 * nrows), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colours = run_colours(list(seeds))
    # Many runs: one legend of run colours under the panels (an in-panel legend would cover the curves).
    crowded = len(seeds) > CROWDED_RUNS
    plotted: dict[str, dict[str, Series]] = {}
    styles = ["-", "--", ":", "-."]
    for ax, pattern in zip(axes, panels, strict=False):
        # Colour = run, line style = metric key (same key, same style in every run).
        panel_keys = sorted({k for logs in seeds.values() for log in logs for k in _match(list(log), pattern)})
        ax.set_title(_panel_title(pattern, panel_keys), fontsize=11)
        drawn = 0
        for name, logs in seeds.items():
            for key in panel_keys:
                have = [log[key] for log in logs if key in log and log[key][0]]
                if not have:
                    continue
                source = metric_title(key)[1]
                if crowded:  # the run's name is in the figure legend
                    label = None
                else:
                    label = name if len(panel_keys) == 1 else f"{name} · {source or key}"
                style = {"color": colours[name], "linestyle": styles[panel_keys.index(key) % len(styles)]}
                if len(logs) > 1:
                    steps, values, lo, hi = _seed_stats(have)
                    if not steps:
                        continue
                    if label is not None:
                        label += f" (mean of {len(have)} seeds, band min–max)"
                    band = (_ema(lo, smooth), _ema(hi, smooth)) if smooth > 0 else (lo, hi)
                    ax.fill_between(steps, *band, color=colours[name], alpha=0.2, linewidth=0)
                else:
                    steps, values = have[0]
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
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(pattern, fontsize=7, color="#666")
            ax.grid(alpha=0.3)
            if not crowded:
                ax.legend(fontsize=7, loc="best")
            elif len(panel_keys) > 1:  # the line styles of this panel's keys
                keys = [Line2D([], [], color="#555", linestyle=styles[i % len(styles)]) for i in range(len(panel_keys))]
                ax.legend(keys, [metric_title(k)[1] or k for k in panel_keys], fontsize=7, loc="best")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if crowded and plotted:
        handles = [Line2D([], [], color=colours[n], linewidth=2) for n in plotted]
        labels, legend_title = figure_legend({n: len(seeds[n]) for n in plotted})
        fig.legend(
            handles, labels, loc="outside lower center", ncols=min(6, len(plotted)), fontsize=8,
            title=legend_title, title_fontsize=8, frameon=False,
        )  # fmt: skip
    if title:
        fig.suptitle(title)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=dpi, facecolor="white")
    return plotted
