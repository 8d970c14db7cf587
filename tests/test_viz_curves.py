"""Training curves from verl's ``file`` logger (written here by verl's own logger classes) and plain JSONL.

Run: cd /work/main && .venv/bin/pytest -q tests/test_viz_curves.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from gtpo.viz.__main__ import main as viz_main
from gtpo.viz.curves import (
    METRIC_TITLES,
    figure_legend,
    load_metrics,
    metric_title,
    parse_run_spec,
    plot_curves,
    run_colours,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VAL_KEY = "val-core/math_dapo/acc/mean@4"


def _train_metrics(step: int, offset: float) -> dict:
    return {
        "critic/score/mean": np.float32(0.25 * step + offset),  # numpy scalars, as the trainer logs them
        "actor/entropy": 1.0 / step + offset,
        "response_length/mean": 100.0 + 10 * step,
        "actor/pg_loss": -0.01 * step,
        "timing_s/step": 3.5,
        "training/global_step": step,
    }


@pytest.fixture()
def verl_logs(tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """Run A: ``Tracking(default_backend=["file"])`` as the trainer builds it (trainer.logger=[..., "file"]), with
    VERL_FILE_LOGGER_ROOT; run B: ``FileLogger`` with VERL_FILE_LOGGER_PATH. Both are verl 0.9.1's classes."""
    from verl.utils.tracking import FileLogger, Tracking

    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "root"))
    tracking = Tracking(project_name="proj", experiment_name="gtpo_run", default_backend=["console", "file"])
    # verl's order: validation before training at step 0, then one line per step (validation merged into it).
    tracking.log(data={VAL_KEY: 0.30, "val-aux/math_dapo/acc/std@4": 0.1}, step=0)
    for step in range(1, 6):
        metrics = _train_metrics(step, 0.0)
        if step in (2, 4):
            metrics[VAL_KEY] = 0.30 + 0.05 * step
        tracking.log(data=metrics, step=step)
    tracking.finish()
    path_a = tmp_path / "root" / "proj" / "gtpo_run.jsonl"  # ${VERL_FILE_LOGGER_ROOT}/<project>/<experiment>.jsonl

    path_b = tmp_path / "b" / "metrics.jsonl"
    path_b.parent.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path_b))
    logger = FileLogger(project_name="proj", experiment_name="grpo_run")
    for step in range(1, 4):
        metrics = _train_metrics(step, 1.0)
        if step == 3:
            metrics["actor/entropy"] = float("nan")  # orjson writes null: not a point
        logger.log(data=metrics, step=step)
    logger.finish()
    return {"gtpo": path_a, "grpo": path_b}


def test_file_logger_format_is_what_we_parse(verl_logs):
    first = json.loads(verl_logs["gtpo"].read_text().splitlines()[1])
    assert set(first) == {"step", "data"} and first["step"] == 1
    assert first["data"]["critic/score/mean"] == 0.25


def test_load_metrics_merges_lines_and_drops_nulls(verl_logs):
    a = load_metrics(verl_logs["gtpo"])
    assert a["critic/score/mean"] == ([1, 2, 3, 4, 5], [0.25, 0.5, 0.75, 1.0, 1.25])
    assert a[VAL_KEY] == ([0, 2, 4], [0.30, 0.40, 0.50])
    assert a["training/global_step"][1] == [1.0, 2.0, 3.0, 4.0, 5.0]
    b = load_metrics(verl_logs["grpo"])
    assert b["actor/entropy"] == ([1, 2], [2.0, 1.5])  # step 3 logged NaN -> null -> left out


def test_plot_two_runs_default_panels(verl_logs, tmp_path):
    out = tmp_path / "plots" / "curves.png"
    series = plot_curves([("gtpo", verl_logs["gtpo"]), ("grpo", verl_logs["grpo"])], out)
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    img = imread(out)
    assert img.shape[0] > 400 and img.shape[1] > 800  # a 2x2 grid
    assert set(series) == {"gtpo", "grpo"}
    assert set(series["gtpo"]) == {"critic/score/mean", "actor/entropy", "response_length/mean", VAL_KEY}
    assert set(series["grpo"]) == {"critic/score/mean", "actor/entropy", "response_length/mean"}  # no validation
    assert series["gtpo"]["critic/score/mean"] == ([1, 2, 3, 4, 5], [0.25, 0.5, 0.75, 1.0, 1.25])
    assert series["grpo"]["critic/score/mean"] == ([1, 2, 3], [1.25, 1.5, 1.75])
    steps, ent = series["gtpo"]["actor/entropy"]
    assert steps == [1, 2, 3, 4, 5] and np.allclose(ent, [1.0 / s for s in steps])
    assert series["gtpo"]["response_length/mean"] == ([1, 2, 3, 4, 5], [110.0, 120.0, 130.0, 140.0, 150.0])
    assert series["gtpo"][VAL_KEY] == ([0, 2, 4], [0.30, 0.40, 0.50])
    # Both runs are drawn in distinct colours: the image has at least two saturated hues.
    rgb = img[..., :3].reshape(-1, 3)
    saturated = rgb[(rgb.max(1) - rgb.min(1)) > 0.4]
    hues = {tuple(np.round(c, 1)) for c in saturated}
    assert len(hues) >= 2


def test_missing_metrics_get_a_panel_not_a_crash(verl_logs, tmp_path):
    out = tmp_path / "c.png"
    series = plot_curves(
        {"grpo": verl_logs["grpo"]}, out, metrics=["val-core/*/acc/mean@*", "no/such/key", "actor/pg_loss"]
    )
    assert series == {"grpo": {"actor/pg_loss": ([1, 2, 3], [-0.01, -0.02, -0.03])}}
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plain_jsonl_and_patterns(tmp_path):
    path = tmp_path / "plain.jsonl"
    rows = [
        {"step": 1, "critic/score/mean": 0.1, "val-core/aime/acc/mean@32": 0.2, "val-core/math/acc/mean@4": 0.5},
        {"step": 2, "critic/score/mean": 0.3, "note": "text is not a point"},
        {"step": 2, "critic/score/mean": 0.4},  # the later line wins for a repeated (step, key)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    series = plot_curves([("plain", path)], tmp_path / "p.png")
    assert series["plain"]["critic/score/mean"] == ([1, 2], [0.1, 0.4])
    assert series["plain"]["val-core/aime/acc/mean@32"] == ([1], [0.2])  # one line per data source
    assert series["plain"]["val-core/math/acc/mean@4"] == ([1], [0.5])
    assert "note" not in load_metrics(path)


def test_bad_logs(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1, "data": {"a": 1}}\n{"step": 2, "data": {"a"\n{"step": 3, "data": {"a": 3}}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2: invalid JSON"):
        load_metrics(p)
    p.write_text('{"step": 1, "data": {"a": 1}}\n{"step": 2, "da')  # a run still writing its last line
    with pytest.warns(UserWarning, match="truncated last line"):
        assert load_metrics(p) == {"a": ([1], [1.0])}
    p.write_text('{"data": {"a": 1}}\n')
    with pytest.raises(ValueError, match="'step'"):
        load_metrics(p)
    with pytest.raises(ValueError, match="not found"):
        load_metrics(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="given twice"):
        plot_curves([("x", p), ("x", p)], tmp_path / "x.png")
    with pytest.raises(ValueError, match="smooth"):
        plot_curves([("x", p)], tmp_path / "x.png", smooth=1.0)


def test_parse_run_spec():
    assert parse_run_spec("gtpo=logs/a.jsonl") == ("gtpo", Path("logs/a.jsonl"))
    assert parse_run_spec("logs/b.jsonl") == ("b", Path("logs/b.jsonl"))
    with pytest.raises(ValueError, match="NAME=path"):
        parse_run_spec("=x")


def test_cli_curves(verl_logs, tmp_path, capsys):
    out = tmp_path / "cli.png"
    argv = ["curves", "--run", f"gtpo={verl_logs['gtpo']}", "--run", f"grpo={verl_logs['grpo']}", "--out", str(out)]
    assert viz_main([*argv, "--smooth", "0.5"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "gtpo: critic/score/mean (5 points)" in printed and f"{VAL_KEY} (3 points)" in printed
    assert viz_main(["curves", "--run", f"x={tmp_path / 'none.jsonl'}", "--out", str(out)]) == 2


@pytest.mark.parametrize(
    ("key", "title", "source"),
    [
        ("critic/score/mean", "mean reward", None),
        ("actor/entropy", "policy entropy", None),
        ("response_length/mean", "response length", None),
        ("val-core/aime24/acc/mean@32", "validation Mean@32", "aime24"),
        ("val-core/math500/acc/Mean@32", "validation Mean@32", "math500"),  # case of the renamed keys
        ("val-core/aime24/acc/pass@4", "validation Pass@4", "aime24"),
        ("val-core/aime24/acc/pass@32/mean", "validation Pass@32", "aime24"),
        ("val-core/aime24/acc/best@32/mean", "validation best@32 (verl bootstrap)", "aime24"),
        ("gtpo/conservation_err", "gtpo/conservation_err", None),  # no entry: the key itself
    ],
)
def test_metric_titles(key, title, source):
    assert metric_title(key) == (title, source)


def test_titles_are_table_driven(monkeypatch):
    import re

    import gtpo.viz.curves as curves

    table = (*METRIC_TITLES, (r"val-core/(?P<source>[^/]+)/acc/worst@(?P<n>\d+)", "validation worst@{n}"))
    monkeypatch.setattr(curves, "_TITLE_RES", tuple((re.compile(rx, re.I), t) for rx, t in table))
    assert curves.metric_title("val-core/amc/acc/worst@8") == ("validation worst@8", "amc")


def _seed_log(path: Path, rewards: list[float], first_step: int = 1) -> Path:
    lines = [json.dumps({"step": first_step + i, "data": {"critic/score/mean": v}}) for i, v in enumerate(rewards)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_seeds_of_one_method_are_mean_and_band(tmp_path):
    s0 = _seed_log(tmp_path / "s0.jsonl", [0.0, 0.2, 0.4, 0.6])
    s1 = _seed_log(tmp_path / "s1.jsonl", [0.2, 0.4, 0.6, 0.8, 1.0])  # one step more: left out of the mean
    s2 = _seed_log(tmp_path / "s2.jsonl", [0.1, 0.3, 0.5, 0.7])
    other = _seed_log(tmp_path / "grpo.jsonl", [0.5, 0.5])
    out = tmp_path / "seeds.png"
    series = plot_curves(
        [("gtpo", s0), ("gtpo", s1), ("gtpo", s2), ("grpo", other)], out, metrics=["critic/score/mean"]
    )
    steps, mean = series["gtpo"]["critic/score/mean"]
    assert steps == [1, 2, 3, 4]  # the steps every seed logged
    assert np.allclose(mean, [0.1, 0.3, 0.5, 0.7])
    assert series["grpo"]["critic/score/mean"] == ([1, 2], [0.5, 0.5])  # a single run stays raw
    # The band: a translucent fill in the first run colour (C0) covers a region, absent without seeds.
    img = imread(out)[..., :3]
    single = tmp_path / "single.png"
    plot_curves([("gtpo", s0), ("grpo", other)], single, metrics=["critic/score/mean"])
    c0 = np.array([0x1F, 0x77, 0xB4]) / 255.0
    band = 1 - 0.2 * (1 - c0)  # C0 at alpha 0.2 over white
    count = lambda im: int((np.abs(im - band).max(-1) < 0.03).sum())  # noqa: E731
    assert count(img) > 500 + 10 * count(imread(single)[..., :3])  # the single-run plot has only antialiased edges


def test_run_colours_are_distinct_for_a_sweep_of_eleven():
    ten = run_colours([f"r{i}" for i in range(10)])
    assert list(ten.values()) == [f"C{i}" for i in range(10)]
    eleven = run_colours([f"r{i}" for i in range(11)])
    assert len(set(eleven.values())) == 11


def test_figure_legend_names_the_seed_count_once_or_per_run():
    assert figure_legend({"a": 3, "b": 3}) == (["a", "b"], "mean of 3 seeds, band min–max")
    assert figure_legend({"a": 1, "b": 1}) == (["a", "b"], None)
    assert figure_legend({"a": 3, "b": 1}) == (["a (mean of 3 seeds)", "b"], "band: min–max over seeds")


def test_crowded_plot_draws_every_run(tmp_path):
    runs = []
    for i in range(8):
        path = tmp_path / f"r{i}.jsonl"
        path.write_text(
            "".join(json.dumps({"step": s, "data": {"critic/score/mean": s * i / 10}}) + "\n" for s in (1, 2))
        )
        runs.append((f"run{i}", path))
    plotted = plot_curves(runs, tmp_path / "c.png", metrics=["critic/score/mean"])
    assert list(plotted) == [f"run{i}" for i in range(8)]
    assert plotted["run5"]["critic/score/mean"] == ([1, 2], [0.5, 1.0])
    assert imread(tmp_path / "c.png").shape[0] > 300
