"""``python -m gtpo.eval`` grades with lenient extraction by default; ``--extraction strict`` is the training reward's.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest -q tests/test_eval_extraction.py
"""

from __future__ import annotations

import json

from gtpo.eval.cli import main

# one problem, four samples: only the boxed one counts under strict extraction
ROWS = [
    {"id": "p1", "problem": "What is 2+3?", "answer": "5", "data_source": "bench", "response": r"so \boxed{5}"},
    {"id": "p1", "problem": "What is 2+3?", "answer": "5", "data_source": "bench", "response": "The answer is 5."},
    {"id": "p1", "problem": "What is 2+3?", "answer": "5", "data_source": "bench", "response": "2 plus 3 gives 5"},
    {"id": "p1", "problem": "What is 2+3?", "answer": "5", "data_source": "bench", "response": "it is 6"},
]


def _run(tmp_path, *flags):
    dump = tmp_path / "gen.jsonl"
    dump.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / ("out" + "".join(flags).replace("-", "_"))
    assert main([str(dump), "--out-dir", str(out), "--ks", "1", "--no-progress", *flags]) == 0
    return json.loads((out / "eval.json").read_text())


def test_eval_defaults_to_lenient_and_strict_is_a_flag(tmp_path, capsys):
    lenient = _run(tmp_path)
    assert lenient["meta"]["extraction"] == "lenient"
    strict = _run(tmp_path, "--extraction", "strict")
    assert strict["meta"]["extraction"] == "strict"
    capsys.readouterr()
    (lenient_bench,) = lenient["results"].values()
    (strict_bench,) = strict["results"].values()
    acc_key = next(k for k in lenient_bench if k.startswith("avg@"))
    assert lenient_bench[acc_key] == 0.75  # boxed, "the answer is", last number
    assert strict_bench[acc_key] == 0.25  # boxed only
