"""The comparison harness (python -m gtpo.cpu.compare): its configurations, its aggregation over seeds by hand, and
a tiny sweep (grpo_s, one seed, two steps) through verl's real trainer writing the table and figure."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from gtpo.cpu import compare, demo


def _write_metrics(path, rewards, entropy=None, step_s=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, r in enumerate(rewards):
        data = {demo.REWARD_KEY: r}
        if entropy is not None:
            data["actor/entropy"] = entropy[i]
        if step_s is not None:
            data["timing_s/step"] = step_s[i]
        lines.append(json.dumps({"step": i + 1, "data": data}))
    path.write_text("\n".join(lines) + "\n")


def test_configurations_cover_the_issue_and_differ_only_in_estimator_knobs():
    assert set(compare.CONFIGURATIONS) == {
        "grpo", "dapo", "dapo_forking", "gtpo_zero_fill", "gtpo_joint", "gtpo_split", "grpo_s_zero_fill",
        "grpo_s_joint", "gtpo_traj_paper", "gtpo_traj_code", "gtpo_conflict_mask",
    }  # fmt: skip
    for name, (method, overrides) in compare.CONFIGURATIONS.items():
        assert name.startswith(method)
        assert all(o.startswith(f"algorithm.{method}.") for o in overrides), name


def test_parse_configs():
    assert compare.parse_configs("grpo, dapo,grpo") == ["grpo", "dapo"]
    with pytest.raises(ValueError, match="unknown \\['nope'\\]"):
        compare.parse_configs("grpo,nope")
    with pytest.raises(ValueError, match="empty"):
        compare.parse_configs(" , ")


def test_run_record_and_aggregate_by_hand(tmp_path):
    # seed 0 reaches a 2-step mean >= 0.8 at step 4; seed 1 never does
    m0, m1 = tmp_path / "s0.jsonl", tmp_path / "s1.jsonl"
    _write_metrics(m0, [0.0, 0.2, 0.8, 1.0], entropy=[3, 2, 1, 0.5], step_s=[10, 2, 4, 3])
    _write_metrics(m1, [0.0, 0.4, 0.4, 0.6], entropy=[3, 3, 2, 1.5], step_s=[12, 1, 1, 1])
    base = {"returncode": 0, "wall_s": 50.0}
    r0 = compare.run_record(m0, {**base, "seed": 0}, window=2, target=0.8)
    r1 = compare.run_record(m1, {**base, "seed": 1}, window=2, target=0.8)
    assert (r0["first_mean"], r0["last_mean"], r0["step_reaching_target"]) == (0.1, 0.9, 4)
    assert r0["final_entropy"] == 0.75 and r0["s_per_step"] == 3.0  # the first step (start-up) left out
    assert (r1["first_mean"], r1["last_mean"], r1["step_reaching_target"]) == (0.2, 0.5, None)
    failed = {**r1, "seed": 2, "returncode": 1, "steps": 1}
    agg = compare.aggregate([r0, r1, failed], steps=4)
    assert (agg["runs"], agg["runs_complete"], agg["target_reached"]) == (3, 2, 1)
    assert math.isclose(agg["first_mean"], 0.15) and math.isclose(agg["first_std"], math.sqrt(0.005))
    assert math.isclose(agg["last_mean"], 0.7) and math.isclose(agg["last_std"], math.sqrt(0.08))
    assert agg["step_reaching_target"] == 4.0
    assert math.isclose(agg["final_entropy"], 1.25) and agg["s_per_step"] == 2.0
    one = compare.aggregate([r1], steps=4)
    assert one["last_std"] is None and one["step_reaching_target"] is None

    results = {"window": 2, "target": 0.8, "configurations": {"grpo": {"aggregate": agg}, "dapo": {"aggregate": one}}}
    table = compare.markdown_table(results).splitlines()
    assert table[0].startswith("| configuration | runs complete | reward, first 2 steps |")
    assert table[2] == "| grpo | 2/3 | 0.15 ± 0.07 | 0.70 ± 0.28 | 4 (1/2 seeds) | 1.25 ± 0.71 | 2.0 ± 1.4 |"
    assert table[3] == "| dapo | 1/1 | 0.20 | 0.50 | never | 1.75 | 1.0 |"


def test_resume_keeps_only_runs_that_finished_the_same_method_and_seed(tmp_path):
    run = tmp_path / "gtpo_zero_fill" / "s1"
    _write_metrics(run / "metrics.jsonl", [0.0, 0.5, 1.0])
    (run / "summary.json").write_text(json.dumps({"method": "gtpo", "seed": 1, "returncode": 0, "wall_s": 9.0}))
    assert compare.finished_run(run, "gtpo", 1, steps=3)["wall_s"] == 9.0
    assert compare.finished_run(run, "gtpo", 1, steps=4) is None  # stopped before the sweep's step count
    assert compare.finished_run(run, "grpo", 1, steps=3) is None
    assert compare.finished_run(run, "gtpo", 0, steps=3) is None
    (run / "summary.json").write_text(json.dumps({"method": "gtpo", "seed": 1, "returncode": 85, "wall_s": 9.0}))
    assert compare.finished_run(run, "gtpo", 1, steps=3) is None
    assert compare.finished_run(tmp_path / "missing", "gtpo", 1, steps=3) is None


def test_run_record_holds_the_series_and_resume_keeps_recorded_runs(tmp_path):
    metrics = tmp_path / "m.jsonl"
    _write_metrics(metrics, [0.0, 0.5, 1.0], entropy=[3.0, 2.0, 1.0], step_s=[9, 2, 2])
    run = compare.run_record(metrics, {"seed": 1, "returncode": 0, "wall_s": 9.0}, window=1, target=0.8)
    assert run["reward"] == [0.0, 0.5, 1.0] and run["entropy"] == [3.0, 2.0, 1.0]
    overrides = ("algorithm.gtpo.norm_mode=joint",)
    results = {
        "steps": 3,
        "configurations": {
            "gtpo_joint": {
                "method": "gtpo",
                "overrides": list(overrides),
                "runs": [run, {**run, "seed": 0, "returncode": 1}],
            }
        },
    }
    assert compare.recorded_run(results, "gtpo_joint", "gtpo", overrides, seed=1, steps=3) is run
    assert compare.recorded_run(results, "gtpo_joint", "gtpo", overrides, seed=0, steps=3) is None  # it failed
    assert compare.recorded_run(results, "gtpo_joint", "gtpo", overrides, seed=1, steps=4) is None
    assert compare.recorded_run(results, "gtpo_joint", "gtpo", (), seed=1, steps=3) is None
    assert compare.recorded_run(results, "gtpo_joint", "grpo", overrides, seed=1, steps=3) is None
    assert compare.recorded_run(results, "grpo", "grpo", (), seed=1, steps=3) is None
    without_series = {**run, "reward": []}
    results["configurations"]["gtpo_joint"]["runs"] = [without_series]
    assert compare.recorded_run(results, "gtpo_joint", "gtpo", overrides, seed=1, steps=3) is None


def test_a_sweep_continues_from_a_copied_results_json_alone(tmp_path, monkeypatch):
    # results.json of an earlier sweep, without its run folders: --resume keeps its runs and trains only the rest
    earlier = tmp_path / "earlier"
    for seed, rewards in ((0, [0.0, 0.5, 1.0]), (1, [0.0, 0.25, 0.75])):
        _write_metrics(earlier / f"s{seed}.jsonl", rewards, entropy=[3, 2, 1], step_s=[9, 2, 2])
    runs = [
        compare.run_record(earlier / f"s{s}.jsonl", {"seed": s, "returncode": 0, "wall_s": 9.0}, 1, 0.8) for s in (0, 1)
    ]
    out = tmp_path / "sweep"
    out.mkdir()
    results = {
        "task": "say_digit",
        "steps": 3,
        "configurations": {"grpo": {"method": "grpo", "overrides": [], "runs": runs}},
    }
    out.joinpath("results.json").write_text(json.dumps(results))
    trained = []

    def fake_run_demo(assets, method, steps, seed, run_out, overrides, **kwargs):
        trained.append((method, seed))
        _write_metrics(run_out / "metrics.jsonl", [0.0, 1.0, 1.0], entropy=[3, 1, 1], step_s=[9, 1, 1])
        return {"method": method, "seed": seed, "returncode": 0, "wall_s": 5.0}

    monkeypatch.setattr(compare, "build_demo_assets", lambda *a, **k: type("A", (), {"model_dir": str(tmp_path)}))
    monkeypatch.setattr(compare, "start_local_ray", lambda *a, **k: "local")

    def stopped_at_dapo_seed_1(assets, method, steps, seed, run_out, overrides, **kwargs):
        if (method, seed) == ("dapo", 1):
            raise KeyboardInterrupt  # the sweep is stopped during its last run
        return fake_run_demo(assets, method, steps, seed, run_out, overrides, **kwargs)

    monkeypatch.setattr(compare, "run_demo", stopped_at_dapo_seed_1)
    argv = ["--configs", "grpo,dapo", "--seeds", "2", "--steps", "3", "--window", "1", "--resume", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        compare.main(argv)
    assert trained == [("dapo", 0)]
    stopped = json.loads(out.joinpath("results.json").read_text())
    assert [r["seed"] for r in stopped["configurations"]["dapo"]["runs"]] == [0]  # every finished run is recorded
    shutil.rmtree(out / "dapo")  # and results.json alone carries it on
    trained.clear()
    monkeypatch.setattr(compare, "run_demo", fake_run_demo)
    assert compare.main(argv) == 0
    assert trained == [("dapo", 1)]
    written = json.loads(out.joinpath("results.json").read_text())
    assert written["configurations"]["grpo"]["runs"] == runs
    assert written["wall_s"] == 9.0 * 2 + 5.0 * 2
    assert [r["seed"] for r in written["configurations"]["dapo"]["runs"]] == [0, 1]
    series = out / "grpo" / "s1" / "series.jsonl"
    assert [json.loads(line)["data"][demo.REWARD_KEY] for line in series.read_text().splitlines()] == [0, 0.25, 0.75]
    assert out.joinpath("rewards.png").read_bytes()[:4] == b"\x89PNG"
    # a results.json of another task is not resumed from
    trained.clear()
    assert compare.main([*argv, "--task", "second_word"]) == 0
    assert trained == [("grpo", 0), ("grpo", 1), ("dapo", 0), ("dapo", 1)]


def test_provenance_names_the_rollout_model_and_versions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 2, "x": 1}))
    record = compare.provenance(str(tmp_path))
    assert "vLLM" in record["rollout"]
    assert record["model"]["model_type"] == "qwen2" and record["model"]["num_attention_heads"] == 2
    assert {"python", "verl", "torch", "vllm"} <= set(record["versions"])
    assert record["commit"]


def test_replot_rewrites_table_and_figure_from_results_json(tmp_path, capsys):
    out = tmp_path / "sweep"
    for seed, rewards in ((0, [0.0, 0.5, 1.0]), (1, [0.0, 0.25, 0.75])):
        _write_metrics(out / "grpo" / f"s{seed}" / "metrics.jsonl", rewards, entropy=[3, 2, 1], step_s=[9, 2, 2])
    runs = [
        compare.run_record(
            out / "grpo" / f"s{s}" / "metrics.jsonl", {"seed": s, "returncode": 0, "wall_s": 9.0}, 1, 0.8
        )
        for s in (0, 1)
    ]
    results = {
        "command": "python -m gtpo.cpu.compare --configs grpo", "machine": "m", "task": "second_word", "steps": 3,
        "seeds": [0, 1], "window": 1, "target": 0.8, "wall_s": 60.0,
        "configurations": {
            "grpo": {"method": "grpo", "overrides": [], "runs": runs, "aggregate": compare.aggregate(runs, 3)},
        },
    }  # fmt: skip
    out.joinpath("results.json").write_text(json.dumps(results))
    assert compare.main(["--replot", "--out", str(out)]) == 0
    table = out.joinpath("results.md").read_text()
    assert table.startswith("Task second_word, 3 steps per run, seeds [0, 1]")
    assert "| grpo | 2/2 | 0.00 ± 0.00 | 0.88 ± 0.18 | 3 (1/2 seeds) | 1.00 ± 0.00 | 2.0 ± 0.0 |" in table
    assert out.joinpath("rewards.png").read_bytes()[:4] == b"\x89PNG"
    assert compare.main(["--replot", "--out", str(tmp_path / "none")]) == 2
    assert "results.json does not exist" in capsys.readouterr().err


def test_task_option(capsys):
    assert compare.build_parser().parse_args([]).task == "say_digit"
    assert compare.build_parser().parse_args(["--task", "second_word"]).task == "second_word"
    with pytest.raises(SystemExit):
        compare.build_parser().parse_args(["--task", "third_word"])
    assert "invalid choice: 'third_word'" in capsys.readouterr().err


# GRPO-S: its own code runs in the trainer (the estimator) and in verl's actor workers (the sequence-level loss).
E2E_CONFIGS = ("grpo_s_zero_fill",)


@pytest.mark.e2e
@pytest.mark.slow  # the default tier's preemption runs took its place; grpo_s's unit tests stay there
def test_tiny_sweep_through_verl_writes_the_table_and_the_figure(ray_cluster, tmp_path):
    """grpo_s, one seed, two steps, on the second task, at world size two on the session's two-node Ray cluster."""
    out = tmp_path / "cmp"
    rc = compare.main(
        ["--configs", ",".join(E2E_CONFIGS), "--seeds", "1", "--steps", "2", "--window", "2", "--out", str(out)]
        + ["--task", "second_word", "--ray-address", ray_cluster.address, "--timeout", "400", "--nnodes", "2"]
    )
    logs = {c: (out / c / "s0" / "train.log") for c in E2E_CONFIGS}
    assert rc == 0, {c: p.read_text(errors="replace")[-3000:] for c, p in logs.items() if p.is_file()}
    results = json.loads((out / "results.json").read_text())
    assert list(results["configurations"]) == list(E2E_CONFIGS)
    assert (results["task"], results["steps"], results["seeds"], results["window"]) == ("second_word", 2, [0], 2)
    for name, cfg in results["configurations"].items():
        (run,) = cfg["runs"]
        assert run["returncode"] == 0 and run["steps"] == 2, name
        assert 0.0 <= run["first_mean"] <= 1.0 and run["final_entropy"] > 0 and run["s_per_step"] > 0
        assert cfg["aggregate"]["runs_complete"] == 1
    # the method's own code ran: GRPO-S's estimator in the trainer and its sequence-level loss in the actor worker ...
    grpo_s = [json.loads(line)["data"] for line in (out / "grpo_s_zero_fill" / "s0" / "metrics.jsonl").open()]
    assert {"grpo_s/adv_abs_mean", "grpo_s/conservation_err", "actor/grpo_s/seq_clipfrac"} <= set(grpo_s[-1])
    # verl's reward workers scored the second word: every dumped sample, and some where the first word would differ
    samples = [
        json.loads(line)
        for c in E2E_CONFIGS
        for dump in sorted((out / c / "s0" / "rollouts").glob("[0-9]*.jsonl"))  # verl's <step>.jsonl, not tokens_*
        for line in dump.read_text().splitlines()
    ]
    assert len(samples) == len(E2E_CONFIGS) * 2 * 8 * 16
    for s in samples:
        assert s["score"] == demo.score_response(s["output"], s["gts"], word_index=1), s
    assert any(demo.score_response(s["output"], s["gts"]) != s["score"] for s in samples)
    table = (out / "results.md").read_text()
    assert table.startswith("Task second_word, 2 steps per run")
    assert "| grpo_s_zero_fill | 1/1 |" in table
    png = (out / "rewards.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_sweeps_own_cluster_is_a_new_local_one(monkeypatch):
    import ray

    seen = {}

    class Context:
        address_info = {"gcs_address": "127.0.0.1:1"}

    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw) or Context())
    monkeypatch.setattr(compare.os, "environ", dict(compare.os.environ))  # start_local_ray writes the CPU env
    assert compare.start_local_ray(2) == "127.0.0.1:1"
    assert seen["address"] == "local" and seen["num_gpus"] == 2
    # a token of its own that the sweep's runs inherit (never authentication turned off)
    assert compare.os.environ["RAY_AUTH_MODE"] == "token"
    token = Path(compare.os.environ["RAY_AUTH_TOKEN_PATH"])
    assert len(token.read_text()) == 64 and token.stat().st_mode & 0o077 == 0
    assert token.parent.stat().st_mode & 0o077 == 0
    # its session folders in a folder only this user may enter (Ray makes them 0777)
    session_root = Path(compare.os.environ["RAY_TMPDIR"])
    assert session_root.stat().st_mode & 0o777 == 0o700 and token.parent.parent == session_root
