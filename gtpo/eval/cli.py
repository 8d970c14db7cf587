"""Offline evaluation of generation dumps: grade (bounded, parallel), then avg@n, unbiased pass@k, maj@k per benchmark.

Usage::

    python -m gtpo.eval DUMP [DUMP ...] [--data PARQUET ...] [--out-dir DIR] [--ks 1,2,4,8,16,32]
                        [--sampling paper|dapo|r1] [--no-regrade] [--num-workers N] [--timeout-s S]
                        [--extraction lenient|strict]
    python -m gtpo.eval presets          # the named sampling presets and their verl overrides

Accepted inputs (JSONL or parquet, one or more files of ONE evaluation run):

* verl validation dumps (``trainer.validation_data_dir``, one ``<step>.jsonl`` per validation): rows
  ``{input, output, gts, score, step, uid, acc?, pred?, ...}``, n rows per prompt. Samples are grouped by the
  prompt uid (``uid`` is ``<prompt uid>_<session>_<index>``; the part before the last two ``_`` fields), or by
  ``input`` when there is no uid. verl's dumps carry no ``data_source``: the recipe's trainer writes
  ``<step>.data_sources.json`` beside them (read automatically, ``gtpo.eval.sources``); otherwise pass the parquet
  files the run validated on with ``--data`` (a prompt is matched by its user message appearing in ``input``),
  else ``--data-source``.
* verl generation outputs (``main_generation``): rows with ``responses`` (list of n strings), ``data_source``,
  ``reward_model.ground_truth`` and a prompt.
* flat rows with ``response``/``output``, ``ground_truth``/``gts``/``answer``, ``data_source`` and a problem key
  (``uid``/``id``/``problem``/``prompt``/``input``).

Rows from different ``step`` values are refused (mixing checkpoints would be silent nonsense). Responses are
regraded with ``gtpo.reward.math`` unless ``--no-regrade`` (then the dump's ``acc`` and ``pred`` are used).
Writes ``eval.md`` (markdown table, percentages), ``eval.json`` (raw fractions, grade-status counts) and
``pass_at_k.png`` to the output directory, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gtpo.eval.metrics import DEFAULT_KS, TABLE1_BENCHMARKS, summarize_groups, table1_columns
from gtpo.eval.presets import SAMPLING_PRESETS, get_preset, hydra_overrides
from gtpo.eval.sources import read_data_sources

__all__ = ["Sample", "evaluate", "load_samples", "main", "render_markdown", "render_table1", "write_plot"]


@dataclass
class Sample:
    """One response to grade: benchmark, problem key, text, gold, and (optionally) a verdict from the dump."""

    data_source: str | None
    group: str
    response: str
    gold: Any
    input_text: str | None = None
    acc: bool | None = None
    pred: str | None = None


def _read_rows(path: Path) -> list[tuple[str, dict]]:
    """(location, row) pairs of a JSONL or parquet file."""
    if path.suffix == ".parquet":
        import pandas as pd

        return [(f"{path}:row {i}", row) for i, row in enumerate(pd.read_parquet(path).to_dict("records"))]
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
    return rows


def _prompt_text(prompt: Any) -> str | None:
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return prompt
    msgs = list(prompt)
    return str(msgs[-1]["content"]) if msgs and isinstance(msgs[-1], dict) else str(prompt)


def _gold(row: dict) -> Any:
    for key in ("gts", "ground_truth", "answer"):
        if row.get(key) is not None:
            return row[key]
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") is not None:
        return rm["ground_truth"]
    return None


def _group_key(row: dict) -> str | None:
    uid = row.get("uid")
    if uid is not None:
        parts = str(uid).rsplit("_", 2)
        return parts[0] if len(parts) == 3 else str(uid)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    candidates = (row.get("id"), extra.get("id"), row.get("problem"), _prompt_text(row.get("prompt")), row.get("input"))
    for value in candidates:
        if value is not None:
            return str(value)
    return None


def load_samples(paths: list[str | Path]) -> list[Sample]:
    """Samples of every file; ValueError naming ``file:line`` and the field for malformed rows or mixed steps."""
    samples: list[Sample] = []
    steps: set = set()
    for path in map(Path, paths):
        # {prompt uid: data_source} written by the recipe's trainer beside a validation dump, if any
        sidecar = read_data_sources(path)
        for where, row in _read_rows(path):
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected an object")
            gold = _gold(row)
            if gold is None:
                raise ValueError(f"{where}: no ground truth (fields gts / ground_truth / answer / reward_model)")
            group = _group_key(row)
            if group is None:
                raise ValueError(f"{where}: no problem key (fields uid / id / problem / prompt / input)")
            if row.get("step") is not None:
                steps.add(row["step"])
            ds = row.get("data_source") or sidecar.get(group)
            input_text = row.get("input") or _prompt_text(row.get("prompt"))
            if row.get("responses") is not None:
                responses = list(row["responses"])
                for j, resp in enumerate(responses):
                    if not isinstance(resp, str):
                        raise ValueError(f"{where}: field 'responses'[{j}] must be a string")
                    samples.append(Sample(ds, group, resp, gold, input_text))
                continue
            resp = row.get("output", row.get("response"))
            if not isinstance(resp, str):
                raise ValueError(f"{where}: field 'output' (or 'response'/'responses') missing or not a string")
            acc = row.get("acc")
            samples.append(
                Sample(ds, group, resp, gold, input_text, None if acc is None else bool(acc), row.get("pred"))
            )
    if len(steps) > 1:
        raise ValueError(f"rows from several steps {sorted(steps)}: evaluate one step's dump at a time")
    return samples


def _attach_data_sources(samples: list[Sample], data_files: list[str], default: str | None) -> None:
    """Fill missing data_source from the validation parquet files (user message contained in the dump's input)."""
    table: list[tuple[str, str]] = []
    for path in data_files:
        for _, row in _read_rows(Path(path)):
            text = _prompt_text(row.get("prompt"))
            if text and row.get("data_source"):
                table.append((text, str(row["data_source"])))
    cache: dict[str, str | None] = {}
    for s in samples:
        if s.data_source:
            continue
        key = s.input_text or s.group
        if key not in cache:
            cache[key] = next((ds for text, ds in table if text in key), None)
        s.data_source = cache[key] or default
        if s.data_source is None:
            raise ValueError(
                f"no data_source for problem {s.group!r}: pass --data <validation parquet> or --data-source NAME"
            )


def evaluate(
    samples: list[Sample],
    ks: tuple[int, ...] = DEFAULT_KS,
    regrade: bool = True,
    num_workers: int | None = None,
    timeout_s: float | None = None,
    progress: bool = False,
    extraction: str = "lenient",
) -> dict[str, dict]:
    """Per data source: metrics of ``summarize_groups`` plus ``grade_status`` counts (when regraded).

    ``extraction``: the reward's answer extraction when regrading (``gtpo.reward.math``): ``lenient`` (the
    evaluation default: the strict answer, then math-verify's own order) or ``strict`` (the training reward's boxed /
    Answer line).
    """
    from gtpo.reward.extract import normalize_for_vote

    statuses: list[str | None] = [None] * len(samples)
    if regrade:
        from gtpo.reward.math import compute_scores_batch

        kwargs = {"timeout_s": timeout_s} if timeout_s else {}
        kwargs["extraction"] = extraction
        outs = compute_scores_batch(
            None,
            [s.response for s in samples],
            [s.gold for s in samples],
            num_workers=num_workers,
            progress=progress,
            **kwargs,
        )
        for s, out, i in zip(samples, outs, range(len(samples)), strict=True):
            s.acc, s.pred, statuses[i] = out["acc"], out["pred"], out["grade_status"]
    else:
        missing = [s.group for s in samples if s.acc is None]
        if missing:
            raise ValueError(f"--no-regrade needs 'acc' in every row; missing for problem {missing[0]!r}")
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, s in enumerate(samples):
        groups[str(s.data_source)][s.group].append(i)
    report: dict[str, dict] = {}
    for ds in sorted(groups):
        idx_lists = list(groups[ds].values())
        accs = [[bool(samples[i].acc) for i in idx] for idx in idx_lists]
        preds = [[normalize_for_vote(samples[i].pred) for i in idx] for idx in idx_lists]
        entry: dict[str, Any] = summarize_groups(accs, preds, ks)
        entry.update(table1_columns(accs))
        entry["no_answer"] = sum(1 for idx in idx_lists for i in idx if not samples[i].pred) / sum(map(len, idx_lists))
        if regrade:
            entry["grade_status"] = dict(Counter(statuses[i] for idx in idx_lists for i in idx))
        report[ds] = entry
    return report


def render_markdown(report: dict[str, dict], title: str = "") -> str:
    """Markdown table; metrics in percent, ``-`` where a k exceeds a benchmark's sample count."""
    metric_cols: list[str] = []
    for prefix in ("avg@", "pass@", "maj@"):
        keys = {k for entry in report.values() for k in entry if k.startswith(prefix)}
        metric_cols += sorted(keys, key=lambda k: (k != "avg@n", int(k.split("@")[1]) if k[-1].isdigit() else 0))
    head = ["data_source", "problems", "n", *metric_cols, "no answer"]
    lines = [f"### {title}", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for ds, e in report.items():
        n = f"{int(e['n_min'])}" if e["n_min"] == e["n_max"] else f"{int(e['n_min'])}-{int(e['n_max'])}"
        cells = [ds, str(int(e["n_problems"])), n]
        cells += [f"{100 * e[c]:.1f}" if c in e else "-" for c in metric_cols]
        cells.append(f"{100 * e['no_answer']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_table1(report: dict[str, dict]) -> str:
    """Paper A's Table 1 columns (AIME24 / AIME25 Mean@n, Pass@4, Pass@32; MATH500 Mean@n) in percent, for the
    benchmarks of ``report`` among ``aime2024``, ``aime2025``, ``math500``; "" when none of them is there."""
    head, cells = [], []
    for source, label, columns in TABLE1_BENCHMARKS:
        entry = report.get(source)
        if entry is None:
            continue
        for column in columns:
            key = next((k for k in entry if k.startswith("Mean@")), column) if column == "Mean" else column
            head.append(f"{label} {key}")
            cells.append(f"{100 * entry[key]:.2f}" if key in entry else "-")
    if not head:
        return ""
    lines = [
        "### Paper A, Table 1 columns",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---:"] * len(head)) + "|",
        "| " + " | ".join(cells) + " |",
        "",
        "Mean@n: mean accuracy over all n samples; Pass@k: unbiased estimator (Chen et al. 2021) from the same n.",
    ]
    return "\n".join(lines) + "\n"


def write_plot(report: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """pass@k against k (log2 axis), one line per data source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for ds, e in report.items():
        ks = sorted(int(k.split("@")[1]) for k in e if k.startswith("pass@"))
        ax.plot(ks, [100 * e[f"pass@{k}"] for k in ks], marker="o", label=ds)
        ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _print_presets() -> int:
    for name, p in SAMPLING_PRESETS.items():
        print(f"{name}: temperature={p.temperature} top_p={p.top_p} n={p.n} do_sample={p.do_sample} ({p.reference})")
        print("  Hydra: sampling=" + name + "   or   " + " ".join(hydra_overrides(name)))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["presets"]:
        return _print_presets()
    parser = argparse.ArgumentParser(prog="python -m gtpo.eval", description=__doc__.split("\n")[0])
    parser.add_argument("dumps", nargs="+", help="JSONL/parquet generation dumps of one evaluation run")
    parser.add_argument("--data", nargs="*", default=[], help="validation parquet(s) to recover data_source")
    parser.add_argument("--data-source", default=None, help="data_source for rows that still have none")
    parser.add_argument("--out-dir", default=None, help="default: <first dump without suffix>_eval/")
    parser.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), help="comma-separated k values")
    parser.add_argument("--sampling", default=None, choices=sorted(SAMPLING_PRESETS), help="label the run")
    parser.add_argument("--no-regrade", action="store_true", help="use the dump's acc/pred instead of regrading")
    parser.add_argument("--num-workers", type=int, default=None, help="grading processes (default: all cores)")
    parser.add_argument("--timeout-s", type=float, default=None, help="hard limit per graded response")
    parser.add_argument(
        "--extraction",
        default="lenient",
        choices=["lenient", "strict"],
        help="answer extraction when regrading: lenient (strict's answer, then math-verify's order) or strict",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        ks = tuple(int(k) for k in args.ks.split(",") if k.strip())
    except ValueError:
        parser.error(f"--ks={args.ks!r}: expected comma-separated integers")
    try:
        samples = load_samples(args.dumps)
        if not samples:
            raise ValueError("no rows in the given files")
        _attach_data_sources(samples, args.data, args.data_source)
        report = evaluate(
            samples, ks, not args.no_regrade, args.num_workers, args.timeout_s, not args.no_progress, args.extraction
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    first = Path(args.dumps[0])
    out_dir = Path(args.out_dir) if args.out_dir else first.with_name(first.name.split(".")[0] + "_eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    title = ", ".join(Path(d).name for d in args.dumps)
    meta: dict[str, Any] = {"inputs": [str(d) for d in args.dumps], "ks": list(ks), "regraded": not args.no_regrade}
    if not args.no_regrade:
        meta["extraction"] = args.extraction
    if args.sampling:
        preset = get_preset(args.sampling)
        meta["sampling"] = preset.as_dict()
        title += f" (sampling={args.sampling}: T={preset.temperature}, top-p={preset.top_p})"
        for ds, e in report.items():
            if int(e["n_min"]) != preset.n:
                n_min = int(e["n_min"])
                print(f"warning: {ds} has {n_min} samples per problem, preset {args.sampling} draws {preset.n}")
    md = render_markdown(report, title)
    table1 = render_table1(report)
    if table1:
        md += "\n" + table1
    (out_dir / "eval.md").write_text(md)
    (out_dir / "eval.json").write_text(json.dumps({"meta": meta, "results": report}, indent=2))
    write_plot(report, out_dir / "pass_at_k.png", title)
    print(md)
    print(f"wrote {out_dir / 'eval.md'}, {out_dir / 'eval.json'}, {out_dir / 'pass_at_k.png'}")
    return 0
