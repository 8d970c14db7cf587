"""Data preparation: JSONL / hub rows -> verl parquet (counts, dedup, schema, templates, clear errors).

Run: cd /work/main && .venv/bin/pytest -q tests/test_data_prepare.py
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gtpo.data.prepare import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    HF_SOURCES,
    SchemaError,
    apply_template,
    build_rows,
    iter_hf_source,
    main,
    map_dapo_row,
    map_generic_row,
    prepare_file,
    read_jsonl,
)

DAPO_TEMPLATE_VERBATIM = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "PROBLEM"
    '\n\nRemember to put your answer on its own line after "Answer:".'
)


def test_dapo_template_is_verbatim():
    assert apply_template("PROBLEM", "dapo") == DAPO_TEMPLATE_VERBATIM
    assert apply_template("P", "boxed").endswith("put your final answer within \\boxed{}.")
    with pytest.raises(ValueError, match="template='nope'"):
        apply_template("P", "nope")


def test_dapo_17k_round_trip(shared_data, tmp_path):
    path, stats = prepare_file(str(shared_data / "dapo_math_17k.jsonl"), tmp_path, split="train")
    assert (stats.read, stats.written, stats.duplicates) == (17917, 17290, 627)
    assert len(stats.conflicts) == 11
    assert all(len(c["answers"]) == 2 for c in stats.conflicts)
    df = pd.read_parquet(path)
    assert len(df) == 17290
    assert df["extra_info"].map(lambda e: e["problem"]).is_unique
    assert list(df["extra_info"].map(lambda e: e["index"])) == list(range(17290))
    row = df.iloc[0]
    assert row["data_source"] == "dapo_math_17k" and row["ability"] == "math"
    assert row["reward_model"] == {"style": "rule", "ground_truth": row["reward_model"]["ground_truth"]}
    msgs = list(row["prompt"])
    assert len(msgs) == 1 and msgs[0]["role"] == "user"
    assert msgs[0]["content"] == DAPO_PREFIX + row["extra_info"]["problem"] + DAPO_SUFFIX
    assert set(row["extra_info"]) == {"id", "split", "index", "problem"} and row["extra_info"]["split"] == "train"


@pytest.mark.parametrize(
    "name,rows", [("aime2024", 30), ("aime2025", 30), ("amc2023", 40), ("math500", 500), ("math_train", 7470)]
)
def test_eval_sets_counts(shared_data, tmp_path, name, rows):
    path, stats = prepare_file(str(shared_data / f"{name}.jsonl"), tmp_path, split="test", template="boxed")
    assert stats.read == rows
    df = pd.read_parquet(path)
    assert len(df) == stats.written == rows - stats.duplicates
    assert (df["data_source"] == name).all()


def test_limit_shuffle_seed(shared_data):
    rows = list(read_jsonl(shared_data / "aime2024.jsonl"))
    a = build_rows(rows, "test", "dapo", shuffle=True, seed=1, limit=5)
    b = build_rows(rows, "test", "dapo", shuffle=True, seed=1, limit=5)
    c = build_rows(rows, "test", "dapo", shuffle=True, seed=2, limit=5)
    plain = build_rows(rows, "test", "dapo", limit=5)
    ids = [[r["extra_info"]["id"] for r in x] for x in (a, b, c, plain)]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert ids[3] == [r["id"] for r in rows[:5]]
    assert [r["extra_info"]["index"] for r in a] == list(range(5))
    assert build_rows(rows, "test", "dapo", data_source="aime")[0]["data_source"] == "aime"


def test_dedup_keeps_first_and_reports_conflicts():
    rows = [
        {"id": "a", "problem": "p1", "answer": "1", "source": "s"},
        {"id": "b", "problem": "p1", "answer": "2", "source": "s"},
        {"id": "c", "problem": "p1", "answer": "1", "source": "s"},
        {"id": "d", "problem": "p2", "answer": "3", "source": "s"},
    ]
    from gtpo.data.prepare import PrepareStats

    stats = PrepareStats()
    out = build_rows(rows, "train", "dapo", stats=stats)
    assert [r["extra_info"]["id"] for r in out] == ["a", "d"]
    assert stats.duplicates == 2
    assert stats.conflicts == [{"kept_id": "a", "kept_answer": "1", "answers": {"1": ["a", "c"], "2": ["b"]}}]
    assert len(build_rows(rows, "train", "dapo", do_dedup=False)) == 4


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"id": "x2", "problem": "p", "source": "s"}', "missing field 'answer'"),
        ('{"id": "x2", "problem": "p", "answer": 5, "source": "s"}', "field 'answer' must be a string"),
        ('{"id": "x2", "problem": "  ", "answer": "5", "source": "s"}', "field 'problem' is empty"),
        ('{"id": "x1", "problem": "q", "answer": "5", "source": "s"}', "field 'id' value 'x1' repeats line 1"),
        ('{"id": "x2", "problem": "p", "answer": "5", "source": "s"', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
    ],
)
def test_malformed_row_names_file_line_and_field(tmp_path, line, needle):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"id": "x1", "problem": "p0", "answer": "1", "source": "s"})
    bad.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(SchemaError) as exc:
        list(read_jsonl(bad))
    assert f"{bad}:3:" in str(exc.value) and needle in str(exc.value)


def test_cli_writes_parquet_and_reports_bad_rows(shared_data, tmp_path, capsys):
    rc = main(
        [
            "--input",
            str(shared_data / "amc2023.jsonl"),
            "--out-dir",
            str(tmp_path),
            "--split",
            "test",
            "--template",
            "boxed",
            "--limit",
            "7",
            "--report",
            str(tmp_path / "r.json"),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert len(pd.read_parquet(tmp_path / "amc2023.parquet")) == 7
    assert json.loads((tmp_path / "r.json").read_text())[str(shared_data / "amc2023.jsonl")]["written"] == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "problem": "p", "answer": "", "source": "s"}\n')
    assert main(["--input", str(bad), "--out-dir", str(tmp_path), "--no-progress"]) == 2
    assert f"{bad}:1: field 'answer' is empty" in capsys.readouterr().err


def test_hf_row_mappers_in_memory():
    dapo_row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_PREFIX + "What is $1+1$?" + DAPO_SUFFIX}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": "a1b2"},
    }
    assert map_dapo_row(dapo_row, 0, "dapo_math_17k") == {
        "id": "dapo-a1b2",
        "problem": "What is $1+1$?",
        "answer": "2",
        "source": "dapo_math_17k",
    }
    m500 = {"problem": "P", "solution": r"\boxed{\frac{1}{2}}", "answer": r"\frac{1}{2}", "unique_id": "test/x/1.json"}
    assert map_generic_row(m500, 3, "math500") == {
        "id": "math500-test/x/1.json",
        "problem": "P",
        "answer": r"\frac{1}{2}",
        "source": "math500",
    }
    # MATH train rows have no answer column: the solution's last box is the answer
    math_row = {"problem": "Q", "solution": r"so \boxed{3} and finally \boxed{\sqrt{2}}.", "level": "Level 5"}
    assert map_generic_row(math_row, 9, "math_train")["answer"] == r"\sqrt{2}"
    assert map_generic_row(math_row, 9, "math_train")["id"] == "math_train-9"
    # AMC answers stored as floats
    assert map_generic_row({"question": "Q", "answer": 27.0, "id": 4}, 0, "amc2023")["answer"] == "27"


def test_hf_source_path_uses_injected_loader_and_dedups(tmp_path):
    calls = []

    def fake_load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        content = DAPO_PREFIX + "Find x." + DAPO_SUFFIX
        row = {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": "7"}}
        # the hub copy repeats every prompt (100x upstream)
        return [dict(row, extra_info={"index": i}) for i in range(3)]

    path, stats = prepare_file("hf:dapo_math_17k", tmp_path, "train", load_dataset=fake_load_dataset)
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")]
    assert (stats.read, stats.written) == (3, 1)
    assert pd.read_parquet(path).iloc[0]["reward_model"]["ground_truth"] == "7"

    def fake_aime25(repo, config=None, split=None):
        return [{"question": f"{config} q{i}", "answer": str(i)} for i in range(2)]

    rows = list(iter_hf_source("aime2025", fake_aime25))
    assert [r["id"] for r in rows] == [
        "aime2025-0-AIME2025-I",
        "aime2025-1-AIME2025-I",
        "aime2025-2-AIME2025-II",
        "aime2025-3-AIME2025-II",
    ]
    assert set(HF_SOURCES) == {"dapo_math_17k", "math_train", "math500", "aime2024", "aime2025", "amc2023"}

    def broken(repo, config=None, split=None):
        return [{"question": "q", "answer": None}]

    with pytest.raises(SchemaError, match=r"hf:HuggingFaceH4/MATH-500\[test\]:0: field 'answer' is empty"):
        list(iter_hf_source("math500", broken))


def test_parquet_loads_in_verl_rlhf_dataset(shared_data, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    path, _ = prepare_file(str(shared_data / "aime2025.jsonl"), tmp_path, "test", template="boxed")
    cfg = OmegaConf.create({"filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache")})
    ds = RLHFDataset(data_files=[str(path)], tokenizer=None, config=cfg)
    item = ds[2]
    assert len(ds) == 30
    assert item["raw_prompt"][0]["role"] == "user" and item["raw_prompt"][0]["content"].endswith("\\boxed{}.")
    assert item["index"] == 2 and item["reward_model"]["style"] == "rule" and item["data_source"] == "aime2025"


def test_a_missing_input_file_is_one_line_naming_it(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", str(missing), "--out-dir", str(tmp_path), "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--input {missing}: no such file" in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.parquet"))
