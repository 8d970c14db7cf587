"""Math problems (JSONL or Hugging Face datasets) -> verl RL parquet files.

Output rows follow verl's ``RLHFDataset`` (``verl/utils/dataset/rl_dataset.py``): ``prompt`` is a chat-message list
(read through ``data.prompt_key=prompt``), ``data_source`` routes the row to the reward and names its validation
metrics, ``reward_model = {"style": "rule", "ground_truth": answer}``, and ``extra_info`` carries ``id``, ``split``,
``index`` (row position in the output file; verl copies it into ``index``) and the raw ``problem``.

Input JSONL rows need ``id``, ``problem``, ``answer`` and ``source`` (strings; ``solution`` optional, ignored),
as in /work/shared/data. Hugging Face sources (``--hf NAME``; see ``HF_SOURCES``) are mapped to the same fields.

Processing order: validate -> deduplicate by exact problem text (first occurrence kept; duplicates whose answers
differ are reported) -> optional shuffle (``--seed``) -> ``--limit``. Templates (``--template``):

* ``dapo``: the DAPO paper's prompt, verbatim: answers on a final ``Answer:`` line.
* ``boxed``: "Please reason step by step, and put your final answer within \\boxed{}." (Qwen2.5-Math / R1 style).

Usage::

    python -m gtpo.data.prepare --input /work/shared/data/dapo_math_17k.jsonl --split train --out-dir data/
    python -m gtpo.data.prepare --input /work/shared/data/aime2024.jsonl /work/shared/data/math500.jsonl \\
        --split test --template boxed --out-dir data/
    python -m gtpo.data.prepare --hf dapo_math_17k --split train --out-dir data/   # needs hub access
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DAPO_PREFIX",
    "DAPO_SUFFIX",
    "HF_SOURCES",
    "TEMPLATES",
    "PrepareStats",
    "SchemaError",
    "apply_template",
    "build_rows",
    "dedup",
    "iter_hf_source",
    "main",
    "prepare_file",
    "read_jsonl",
    "to_verl_row",
    "write_parquet",
]

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
BOXED_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
TEMPLATES: dict[str, tuple[str, str]] = {"dapo": (DAPO_PREFIX, DAPO_SUFFIX), "boxed": ("", BOXED_SUFFIX)}
REQUIRED_FIELDS = ("id", "problem", "answer", "source")


class SchemaError(ValueError):
    """A malformed input row; the message names ``file:line`` and the offending field."""


def apply_template(problem: str, template: str) -> str:
    """User message for ``problem`` under the named template."""
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r}: expected one of {sorted(TEMPLATES)}")
    prefix, suffix = TEMPLATES[template]
    return prefix + problem + suffix


def _check_row(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in REQUIRED_FIELDS:
        if key not in row:
            raise SchemaError(f"{where}: missing field {key!r} (required: {', '.join(REQUIRED_FIELDS)})")
        if not isinstance(row[key], str):
            raise SchemaError(f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}")
    for key in ("id", "problem", "answer"):
        if not row[key].strip():
            raise SchemaError(f"{where}: field {key!r} is empty")
    return row


def read_jsonl(path: str | Path) -> Iterator[dict]:
    """Validated rows of a JSONL file (blank lines skipped). Raises SchemaError naming ``path:line`` and field."""
    path = Path(path)
    seen_ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SchemaError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            row = _check_row(row, where)
            if row["id"] in seen_ids:
                raise SchemaError(f"{where}: field 'id' value {row['id']!r} repeats line {seen_ids[row['id']]}")
            seen_ids[row["id"]] = lineno
            yield row


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face sources (only used with hub access; mappers are unit-tested with in-memory rows)
# ---------------------------------------------------------------------------------------------------------------

_DAPO_TEMPLATE_RE = re.compile(re.escape(DAPO_PREFIX) + r"(?P<problem>.*)" + re.escape(DAPO_SUFFIX) + r"\s*$", re.S)


def _last_boxed(text: str) -> str | None:
    from gtpo.reward.extract import last_boxed

    ans, _, status = last_boxed(text)
    return ans if status == "ok" else None


def _first(row: dict, keys: Iterable[str]) -> Any:
    for key in keys:
        if key in row and row[key] is not None and str(row[key]).strip() != "":
            return row[key]
    return None


def map_dapo_row(row: dict, index: int, source: str) -> dict:
    """BytedTsinghua-SIA/DAPO-Math-17k row (prompt messages with the DAPO template, reward_model.ground_truth)."""
    prompt = row["prompt"]
    content = prompt[-1]["content"] if isinstance(prompt, list | tuple) else str(prompt)
    m = _DAPO_TEMPLATE_RE.match(content)
    problem = m.group("problem") if m else content
    extra = row.get("extra_info") or {}
    rid = extra.get("index", index)
    answer = str(row["reward_model"]["ground_truth"])
    return {"id": f"dapo-{rid}", "problem": problem, "answer": answer, "source": source}


def map_generic_row(row: dict, index: int, source: str) -> dict:
    """Rows with a problem/question column and an answer column (or a solution with a final ``\\boxed{}``)."""
    problem = _first(row, ("problem", "question", "Problem", "Question"))
    answer = _first(row, ("answer", "Answer", "final_answer", "expected_answer"))
    if answer is None:
        solution = _first(row, ("solution", "Solution"))
        answer = _last_boxed(str(solution)) if solution is not None else None
    rid = _first(row, ("id", "unique_id", "ID", "problem_idx", "idx"))
    if isinstance(answer, float) and answer.is_integer():
        # AMC/AIME answers are sometimes stored as floats (27.0)
        answer = int(answer)
    return {
        "id": f"{source}-{rid if rid is not None else index}",
        "problem": "" if problem is None else str(problem),
        "answer": "" if answer is None else str(answer),
        "source": source,
    }


@dataclass(frozen=True)
class HFSource:
    """Where a public data set lives on the hub and how its rows map to id/problem/answer/source."""

    repo: str
    split: str
    mapper: Callable[[dict, int, str], dict]
    configs: tuple[str | None, ...] = (None,)


HF_SOURCES: dict[str, HFSource] = {
    "dapo_math_17k": HFSource("BytedTsinghua-SIA/DAPO-Math-17k", "train", map_dapo_row),
    "math_train": HFSource("DigitalLearningGmbH/MATH-lighteval", "train", map_generic_row),
    "math500": HFSource("HuggingFaceH4/MATH-500", "test", map_generic_row),
    "aime2024": HFSource("HuggingFaceH4/aime_2024", "train", map_generic_row),
    "aime2025": HFSource("opencompass/AIME2025", "test", map_generic_row, ("AIME2025-I", "AIME2025-II")),
    "amc2023": HFSource("math-ai/amc23", "test", map_generic_row),
}


def iter_hf_source(name: str, load_dataset: Callable | None = None) -> Iterator[dict]:
    """Validated rows of a registered hub data set (``load_dataset`` is injectable for tests)."""
    if name not in HF_SOURCES:
        raise ValueError(f"hf source {name!r}: expected one of {sorted(HF_SOURCES)}")
    spec = HF_SOURCES[name]
    if load_dataset is None:
        from datasets import load_dataset
    index = 0
    for config in spec.configs:
        ds = load_dataset(spec.repo, config, split=spec.split) if config else load_dataset(spec.repo, split=spec.split)
        for i, raw in enumerate(ds):
            where = f"hf:{spec.repo}{'/' + config if config else ''}[{spec.split}]:{i}"
            row = spec.mapper(dict(raw), index, name)
            # configs share the id space ("aime2025-1" in part I and II): suffix the config name
            if config and len(spec.configs) > 1:
                row["id"] = f"{row['id']}-{config}"
            yield _check_row(row, where)
            index += 1


# ---------------------------------------------------------------------------------------------------------------
# dedup / rows / parquet
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PrepareStats:
    """What ``build_rows`` did; ``conflicts`` lists duplicated problems whose answers differ."""

    read: int = 0
    duplicates: int = 0
    written: int = 0
    conflicts: list[dict] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"read {self.read}, duplicates dropped {self.duplicates} "
            f"({len(self.conflicts)} with conflicting answers), written {self.written}"
        )


def dedup(rows: Iterable[dict], stats: PrepareStats | None = None) -> list[dict]:
    """First occurrence of each exact problem text; conflicting answers among duplicates go to ``stats``."""
    stats = stats if stats is not None else PrepareStats()
    first: dict[str, dict] = {}
    answers: dict[str, dict[str, list[str]]] = {}
    for row in rows:
        stats.read += 1
        key = row["problem"]
        if key in first:
            stats.duplicates += 1
        else:
            first[key] = row
        answers.setdefault(key, {}).setdefault(row["answer"], []).append(row["id"])
    for key, by_answer in answers.items():
        if len(by_answer) > 1:
            stats.conflicts.append(
                {"kept_id": first[key]["id"], "kept_answer": first[key]["answer"], "answers": by_answer}
            )
    return list(first.values())


def to_verl_row(row: dict, index: int, split: str, template: str, data_source: str | None = None) -> dict:
    """One verl RL row (see module docstring)."""
    return {
        "data_source": data_source or row["source"],
        "prompt": [{"role": "user", "content": apply_template(row["problem"], template)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": row["answer"]},
        "extra_info": {"id": row["id"], "split": split, "index": index, "problem": row["problem"]},
    }


def build_rows(
    rows: Iterable[dict],
    split: str,
    template: str,
    do_dedup: bool = True,
    shuffle: bool = False,
    seed: int = 0,
    limit: int | None = None,
    data_source: str | None = None,
    stats: PrepareStats | None = None,
) -> list[dict]:
    """Validated input rows -> verl rows (dedup, then shuffle, then limit)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit={limit}: must be >= 0")
    apply_template("", template)  # fail early on a bad template name
    stats = stats if stats is not None else PrepareStats()
    if do_dedup:
        kept = dedup(rows, stats)
    else:
        kept = list(rows)
        stats.read += len(kept)
    if shuffle:
        import numpy as np

        order = np.random.default_rng(seed).permutation(len(kept))
        kept = [kept[i] for i in order]
    if limit is not None:
        kept = kept[:limit]
    out = [to_verl_row(r, i, split, template, data_source) for i, r in enumerate(kept)]
    stats.written += len(out)
    return out


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def _progress(rows: Iterable[dict], desc: str, enabled: bool) -> Iterable[dict]:
    if not enabled:
        return rows
    from tqdm import tqdm

    return tqdm(rows, desc=desc, unit="row", file=sys.stderr)


def prepare_file(
    source: str,
    out_dir: str | Path,
    split: str,
    template: str = "dapo",
    do_dedup: bool = True,
    shuffle: bool = False,
    seed: int = 0,
    limit: int | None = None,
    data_source: str | None = None,
    progress: bool = False,
    load_dataset: Callable | None = None,
) -> tuple[Path, PrepareStats]:
    """``source`` = a JSONL path or ``hf:<name>``; writes ``<out_dir>/<stem>.parquet``."""
    if source.startswith("hf:"):
        name = source[3:]
        rows: Iterable[dict] = iter_hf_source(name, load_dataset)
        stem = name
    else:
        rows = read_jsonl(source)
        stem = Path(source).stem
    stats = PrepareStats()
    out_rows = build_rows(
        _progress(rows, stem, progress), split, template, do_dedup, shuffle, seed, limit, data_source, stats
    )
    path = write_parquet(out_rows, Path(out_dir) / f"{stem}.parquet")
    return path, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gtpo.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="*", default=[], help="JSONL files with id/problem/answer/source")
    parser.add_argument("--hf", nargs="*", default=[], choices=sorted(HF_SOURCES), help="hub data sets")
    parser.add_argument("--out-dir", required=True, help="one <name>.parquet per input is written here")
    parser.add_argument("--split", default="train", help="stored in extra_info.split")
    parser.add_argument("--template", default="dapo", choices=sorted(TEMPLATES))
    parser.add_argument("--data-source", default=None, help="override data_source (default: the row's source)")
    parser.add_argument("--no-dedup", action="store_true", help="keep duplicated problem texts")
    parser.add_argument("--shuffle", action="store_true", help="shuffle rows (after dedup, before --limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="keep at most this many rows per input")
    parser.add_argument("--report", default=None, help="write a JSON report (counts, answer conflicts) here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    sources = list(args.input) + [f"hf:{name}" for name in args.hf]
    if not sources:
        parser.error("give --input FILE... and/or --hf NAME...")
    missing = [path for path in args.input if not Path(path).is_file()]
    if missing:
        parser.error(f"--input {' '.join(missing)}: no such file (a JSONL file with id/problem/answer/source per line)")
    report = {}
    for source in sources:
        try:
            path, stats = prepare_file(
                source,
                args.out_dir,
                args.split,
                args.template,
                not args.no_dedup,
                args.shuffle,
                args.seed,
                args.limit,
                args.data_source,
                progress=not args.no_progress,
            )
        except SchemaError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{source} -> {path}: {stats.summary()}")
        for c in stats.conflicts:
            print(f"  conflicting answers for {c['kept_id']} (kept {c['kept_answer']!r}): {c['answers']}")
        report[source] = {"output": str(path), **stats.__dict__}
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
