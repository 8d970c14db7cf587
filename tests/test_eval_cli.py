"""Offline evaluation CLI end to end on small synthetic dumps, and the sampling presets (YAML == python table).

Run: cd /work/main && .venv/bin/pytest -q tests/test_eval_cli.py
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from gtpo.data.prepare import build_rows, write_parquet
from gtpo.eval.cli import main
from gtpo.eval.metrics import pass_at_k
from gtpo.eval.presets import SAMPLING_PRESETS, hydra_overrides

REPO = Path(__file__).resolve().parents[1]

# two benchmarks; per problem a list of (response, correct?) with n = 4
PROBLEMS = {
    "bench_a": [
        ("What is 1+1?", "2", [r"\boxed{2}", r"\boxed{3}", "Answer: 2", "no idea"]),
        ("What is 2+3?", "5", [r"\boxed{4}", r"\boxed{4}", r"\boxed{6}", r"\boxed{5}"]),
    ],
    "bench_b": [
        ("Half of one?", r"\frac{1}{2}", [r"\boxed{\dfrac12}", r"\boxed{0.5}", r"\boxed{1}", r"\boxed{\frac{1}{2}}"]),
    ],
}
CORRECT = {"What is 1+1?": 2, "What is 2+3?": 1, "Half of one?": 3}


def _write_verl_dump(tmp_path: Path, step: int = 10, with_acc: bool = False) -> tuple[Path, Path]:
    """A dump shaped like verl's ``_write_generations`` plus the validation parquet it was generated from."""
    rows, dump = [], []
    for ds, problems in PROBLEMS.items():
        src_rows = [{"id": q, "problem": q, "answer": a, "source": ds} for q, a, _ in problems]
        rows += build_rows(src_rows, "test", "boxed")
    data = write_parquet(rows, tmp_path / "val.parquet")
    for row in rows:
        problem = row["extra_info"]["problem"]
        answer = row["reward_model"]["ground_truth"]
        responses = next(r for q, _, r in sum(PROBLEMS.values(), []) if q == problem)
        uid = str(uuid.uuid4())
        chat = "system\nYou are a helpful assistant.\nuser\n" + row["prompt"][0]["content"] + "\nassistant\n"
        for j, resp in enumerate(responses):
            entry = {"input": chat, "output": resp, "gts": answer, "score": 0.0, "step": step, "uid": f"{uid}_{j}_0"}
            if with_acc:
                entry |= {"acc": j == 0, "pred": "x"}
            dump.append(entry)
    path = tmp_path / f"{step}.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in dump) + "\n")
    return path, data


def test_cli_on_verl_validation_dump(tmp_path, capsys):
    dump, data = _write_verl_dump(tmp_path)
    out = tmp_path / "out"
    rc = main([str(dump), "--data", str(data), "--out-dir", str(out), "--num-workers", "2", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "eval.json").read_text())["results"]
    assert set(res) == {"bench_a", "bench_b"}
    a, b = res["bench_a"], res["bench_b"]
    assert a["n_problems"] == 2 and a["n_min"] == 4
    assert a["avg@n"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    for k in (1, 2, 4):
        assert a[f"pass@{k}"] == pytest.approx((pass_at_k(4, 2, k) + pass_at_k(4, 1, k)) / 2)
        assert b[f"pass@{k}"] == pytest.approx(pass_at_k(4, 3, k))
    assert "pass@8" not in a
    # votes: p1 {2: 2, 3: 1} -> right; p2 {4: 2, ...} -> wrong; bench_b: \frac12 x2 vs 0.5 vs 1 -> right
    assert a["maj@4"] == 0.5 and b["maj@4"] == 1.0
    assert a["no_answer"] == pytest.approx(1 / 8)
    assert a["grade_status"] == {"ok": 7, "no_answer": 1}
    md = (out / "eval.md").read_text()
    assert "| data_source | problems | n | avg@n | pass@1 | pass@2 | pass@4 |" in md
    assert "| bench_b | 1 | 4 | 75.0 | 75.0 | 100.0 | 100.0 |" in md
    assert (out / "pass_at_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench_a" in capsys.readouterr().out


def test_cli_no_regrade_uses_dump_verdicts(tmp_path):
    dump, data = _write_verl_dump(tmp_path, with_acc=True)
    out = tmp_path / "o"
    assert main([str(dump), "--data", str(data), "--out-dir", str(out), "--no-regrade", "--no-progress"]) == 0
    res = json.loads((out / "eval.json").read_text())["results"]
    # the dump says exactly the first of 4 samples is correct everywhere
    assert res["bench_a"]["avg@n"] == 0.25 and res["bench_a"]["pass@4"] == 1.0


def test_cli_generation_parquet_and_sampling_label(tmp_path, capsys):
    rows = []
    for ds, problems in PROBLEMS.items():
        for q, a, responses in problems:
            rows.append(
                {
                    "data_source": ds,
                    "prompt": [{"role": "user", "content": q}],
                    "responses": responses,
                    "reward_model": {"style": "rule", "ground_truth": a},
                }
            )
    path = tmp_path / "gen.parquet"
    pd.DataFrame(rows).to_parquet(path)
    out = tmp_path / "g"
    assert main([str(path), "--out-dir", str(out), "--sampling", "r1", "--ks", "1,4", "--no-progress"]) == 0
    payload = json.loads((out / "eval.json").read_text())
    assert payload["meta"]["sampling"]["temperature"] == 0.6
    assert set(k for k in payload["results"]["bench_a"] if k.startswith("pass@")) == {"pass@1", "pass@4"}
    assert payload["results"]["bench_b"]["pass@1"] == 0.75
    assert "preset r1 draws 32" in capsys.readouterr().out


def test_cli_errors_are_clear(tmp_path, capsys):
    d1, data = _write_verl_dump(tmp_path, step=1)
    d2, _ = _write_verl_dump(tmp_path, step=2)
    assert main([str(d1), str(d2), "--data", str(data), "--no-progress"]) == 2
    assert "several steps [1, 2]" in capsys.readouterr().err
    assert main([str(d1), "--no-progress"]) == 2
    assert "--data" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"output": "x", "uid": "a_0_0"}) + "\n")
    assert main([str(bad), "--data-source", "x", "--no-progress"]) == 2
    assert f"{bad}:1: no ground truth" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(SAMPLING_PRESETS))
def test_sampling_yaml_matches_python_presets(name):
    path = REPO / "configs" / "sampling" / f"{name}.yaml"
    assert path.read_text().splitlines()[0] == "# @package _global_"
    cfg = OmegaConf.to_container(OmegaConf.load(path))
    assert cfg == {"actor_rollout_ref": {"rollout": {"val_kwargs": SAMPLING_PRESETS[name].val_kwargs()}}}
    assert set(SAMPLING_PRESETS[name].val_kwargs()) == {"temperature", "top_p", "do_sample", "n"}


def test_presets_values_and_cli(capsys):
    # paper A, Sec. 3.1: temperature 1.0, top-p 1.0; 32 samples for Mean@32 / Pass@32
    assert (SAMPLING_PRESETS["paper"].temperature, SAMPLING_PRESETS["paper"].top_p) == (1.0, 1.0)
    assert SAMPLING_PRESETS["paper"].n == 32 and SAMPLING_PRESETS["paper"].do_sample
    assert (SAMPLING_PRESETS["dapo"].temperature, SAMPLING_PRESETS["dapo"].top_p) == (1.0, 0.7)
    assert (SAMPLING_PRESETS["r1"].temperature, SAMPLING_PRESETS["r1"].top_p) == (0.6, 0.95)
    assert "actor_rollout_ref.rollout.val_kwargs.top_p=0.95" in hydra_overrides("r1")
    assert main(["presets"]) == 0
    assert "sampling=dapo" in capsys.readouterr().out


def test_cli_reads_the_trainers_data_sources_and_prints_table1_columns(tmp_path, capsys):
    """A dump with the trainer's ``<step>.data_sources.json`` beside it splits by benchmark without --data, and the
    Table 1 columns (AIME24 Mean@n / Pass@4, MATH500 Mean@n) come out in the paper's order."""
    from gtpo.eval.sources import read_data_sources, sidecar_path, write_data_sources

    dump, _ = _write_verl_dump(tmp_path, step=7)
    uids, sources = [], []
    for line in dump.read_text().splitlines():
        row = json.loads(line)
        uids.append(row["uid"].rsplit("_", 2)[0])
        # bench_a's problems play AIME 2024, bench_b's MATH 500
        sources.append("math500" if "Half of one" in row["input"] else "aime2024")
    written = write_data_sources(tmp_path, 7, uids, sources)
    assert written == sidecar_path(dump) == tmp_path / "7.data_sources.json"
    assert read_data_sources(dump) == dict(zip(uids, sources, strict=True))
    with pytest.raises(ValueError, match="two data sources"):
        write_data_sources(tmp_path / "x", 7, ["u", "u"], ["aime2024", "math500"])

    out = tmp_path / "t1"
    assert main([str(dump), "--out-dir", str(out), "--sampling", "paper", "--num-workers", "2", "--no-progress"]) == 0
    res = json.loads((out / "eval.json").read_text())["results"]
    assert set(res) == {"aime2024", "math500"}
    assert res["aime2024"]["Mean@4"] == pytest.approx(3 / 8) and res["aime2024"]["Pass@4"] == 1.0
    assert res["math500"]["Mean@4"] == pytest.approx(3 / 4)
    printed = capsys.readouterr().out
    assert "| AIME24 Mean@4 | AIME24 Pass@4 | AIME24 Pass@32 | MATH500 Mean@4 |" in printed
    assert "| 37.50 | 100.00 | - | 75.00 |" in printed
    assert printed.count("### Paper A, Table 1 columns") == 1
    assert "Table 1 columns" in (out / "eval.md").read_text()
