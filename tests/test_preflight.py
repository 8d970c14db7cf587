"""gtpo/launch/preflight.py against a temporary "cluster" layout: every check passes on a good setup and fails,
naming its item, on a broken one.

    .venv/bin/pytest -q tests/test_preflight.py

The layout is a shared folder with verl-style parquet data, a model folder (config.json, tokenizer, weights) and a
checkpoint folder. Nodes are a fake cluster whose reports come from the real :func:`node_report` (it reads the
checkpoint token file) with the driver version, GPU count and interface addresses a real node would report; a node
that does not share the checkpoint folder reads another folder. The last tests go through the launch script
(``PREFLIGHT=1 bash scripts/run_gtpo_qwen2.5_<size>.sh``) with a fake ``nvidia-smi``. No Ray is started.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN_ROWS = 17_290
ITEMS = [
    "config",
    "overlong buffer",
    "train data",
    "val data",
    "run length",
    "model",
    "trackers",
    "checkpoint cadence",
    "checkpoint dir",
    "ray cluster",
    "checkpoint shared",
    "driver",
    "interfaces",
]


def write_layout(root: Path, model_name: str = "Qwen2.5-7B", positions: int = 131072) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file

    data = root / "data"
    data.mkdir(parents=True)

    def rows(n: int) -> dict:
        return {
            "data_source": ["math_dapo"] * n,
            "prompt": [[{"role": "user", "content": f"1+{i}? Answer:"}] for i in range(n)],
            "reward_model": [{"style": "rule", "ground_truth": str(1 + i)} for i in range(n)],
        }

    # The file names `python -m gtpo.data.prepare` writes, which the launch scripts default to; the training set
    # has DAPO-Math-17k's 17,290 problems (135 steps of 128 prompts per epoch).
    for name in ("dapo_math_17k", "aime2024", "aime2025", "math500"):
        pq.write_table(pa.table(rows(TRAIN_ROWS if name == "dapo_math_17k" else 3)), data / f"{name}.parquet")
    model = root / "models" / model_name
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": positions}))
    (model / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    return {
        "train": data / "dapo_math_17k.parquet",
        "val": data / "aime2024.parquet",
        "model": model,
        "ckpts": root / "ckpts" / "gtpo-reproduction" / "gtpo-qwen2.5-7b",
    }


class FakeCluster:
    """Nodes of a cluster; each report is node_report's, with what that node's hardware would say."""

    remote = True

    def __init__(self, n=1, gpus=8, driver="580.65.06", interfaces=None, address="10.1.2.{k}", unshared=None, **node):
        self.specs = []
        for k in range(1, n + 1):
            spec = {"node": f"gpu-a0{k}", "gpus": gpus, "driver": driver, "address": address.format(k=k)}
            spec["interfaces"] = dict(interfaces if interfaces is not None else {"ib0": f"10.1.2.{k}"})
            spec.update(node.get(f"node{k}", {}))
            self.specs.append(spec)
        self.unshared = unshared  # (node number, folder it sees instead)

    def nodes(self):
        return [{"node": s["node"], "address": s["address"], "gpus": s["gpus"]} for s in self.specs]

    def run_on_each(self, nodes, fn, token_path, interfaces):
        assert [n["node"] for n in nodes] == [s["node"] for s in self.specs]
        reports = []
        for k, spec in enumerate(self.specs, start=1):
            path = token_path
            if self.unshared and self.unshared[0] == k:
                path = str(self.unshared[1] / Path(token_path).name)
            report = fn(path, interfaces)
            report.update(node=spec["node"], driver=spec["driver"], gpus=spec["gpus"])
            report["interfaces"] = {name: spec["interfaces"].get(name) for name in interfaces}
            reports.append(report)
        return reports


# The model presets log to verl's file logger too: the launchers put its folder under CKPTS_DIR.
GOOD_ENV = {
    "WANDB_MODE": "offline",
    "GLOO_SOCKET_IFNAME": "ib0",
    "NCCL_SOCKET_IFNAME": "ib0",
    "VERL_FILE_LOGGER_ROOT": "/shared/verl/ckpts/logs",
}


@pytest.fixture
def layout(tmp_path):
    return write_layout(tmp_path / "shared" / "verl")


@pytest.fixture
def compose(monkeypatch):
    import verl  # noqa: F401

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.dry_run import compose_config

    monkeypatch.chdir(REPO)

    def build(layout, *overrides, method="gtpo"):
        return compose_config(
            [
                f"method={method}",
                "model=qwen2.5_7b",
                f"data.train_files={layout['train']}",
                f"data.val_files={layout['val']}",
                f"actor_rollout_ref.model.path={layout['model']}",
                f"trainer.default_local_dir={layout['ckpts']}",
                "trainer.nnodes=1",
                *overrides,
            ]
        )

    return build


def run(cfg, cluster, env=None):
    from gtpo.launch.preflight import run_preflight

    out = io.StringIO()
    rc = run_preflight(cfg, cluster, env=GOOD_ENV if env is None else env, out=out)
    return rc, out.getvalue().splitlines()


def test_good_layout_passes_every_check(compose, layout):
    rc, lines = run(compose(layout), FakeCluster())
    assert rc == 0, "\n".join(lines)
    parsed = [re.match(r"\[preflight\] (ok|FAIL) +([^:]+): ", line).groups() for line in lines[:-1]]
    assert parsed == [("ok", item) for item in ITEMS]
    assert lines[-1].startswith(f"[preflight] OK: {len(ITEMS)} checks passed in ")
    # The token file is gone afterwards.
    assert not list(layout["ckpts"].glob(".preflight-*"))


def _fail_line(lines, item):
    fails = [line for line in lines if line.split()[1] == "FAIL"]
    assert len(fails) == 1 and fails[0] == lines[-1], "\n".join(lines)
    assert fails[0].startswith(f"[preflight] FAIL {item}: "), fails[0]
    # Every check before it passed, none ran after it.
    assert len(lines) == ITEMS.index(item) + 1
    return fails[0]


def _break_file(path: Path) -> None:
    path.write_bytes(b"not parquet")


@pytest.mark.parametrize(
    "item,overrides,expect",
    [
        ("config", ["actor_rollout_ref.actor.ppo_mini_batch_size=256"], "ppo_mini_batch_size=256 > data.train_batch"),
        ("train data", ["data.train_files=/nonexistent/train.parquet"], "/nonexistent/train.parquet does not exist"),
        ("val data", ["data.prompt_key=question"], None),  # train data fails first unless the column exists there
        ("model", ["actor_rollout_ref.model.path=Qwen/Qwen2.5-7B"], "is not a local folder"),
        ("checkpoint cadence", ["trainer.save_freq=-1"], "trainer.save_freq=-1"),
    ],
)
def test_broken_config_fails_its_check(compose, layout, item, overrides, expect):
    if item == "val data":
        import pyarrow as pa
        import pyarrow.parquet as pq

        row = {"data_source": ["d"], "reward_model": [{"ground_truth": "1"}]}
        pq.write_table(pa.table({**row, "question": [[{"role": "user", "content": "q"}]]}), layout["train"])
        pq.write_table(pa.table({**row, "prompt": [[{"role": "user", "content": "q"}]]}), layout["val"])
        expect = "has no column question (data.prompt_key=question"
    if "max_response_length" in overrides[0]:
        # keep the batch plan valid so that only the model's context length is wrong
        overrides = [
            *overrides,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=60000",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=60000",
        ]
    rc, lines = run(compose(layout, *overrides), FakeCluster())
    assert rc == 1
    assert expect in _fail_line(lines, item)


def test_model_shorter_than_prompt_plus_response_fails(compose, tmp_path):
    # A model whose context (4096 positions) is shorter than paper A's 2048 + 4096 tokens.
    short = write_layout(tmp_path / "shared" / "verl", positions=4096)
    rc, lines = run(compose(short), FakeCluster())
    assert rc == 1
    assert "max_position_embeddings=4096 <" in _fail_line(lines, "model")


def test_overlong_buffer_longer_than_the_response_fails(compose, layout):
    rc, lines = run(compose(layout, "reward.reward_kwargs.overlong_buffer_cfg.len=30000", method="dapo"), FakeCluster())
    assert rc == 1
    # The dry run may catch it first (config); either way it is named and nothing after it runs.
    (fail,) = [line for line in lines if " FAIL " in line]
    assert fail == lines[-1] and "overlong_buffer_cfg.len" in fail
    assert fail.startswith(("[preflight] FAIL overlong buffer: ", "[preflight] FAIL config: "))


def test_unreadable_train_file_fails(compose, layout):
    _break_file(layout["train"])
    rc, lines = run(compose(layout), FakeCluster())
    assert rc == 1 and "is not a readable parquet file" in _fail_line(lines, "train data")


def test_model_without_weights_fails(compose, layout):
    (layout["model"] / "model.safetensors").unlink()
    rc, lines = run(compose(layout), FakeCluster())
    assert rc == 1 and "no weights" in _fail_line(lines, "model")


@pytest.mark.parametrize(
    "weights,expect",
    [
        ({"model.safetensors": b""}, "model.safetensors: 0 bytes, not a safetensors file"),
        ({"model.safetensors": "truncated"}, r"model.safetensors: \d+ bytes, its header lists"),
        ({"model-00001-of-00002.safetensors": "whole", "index": ["model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"]},
         r"names 2 shards, 1 missing \(model-00002-of-00002\.safetensors\)"),
    ],
    ids=["zero-byte", "truncated", "missing-shard"],
)  # fmt: skip
def test_incomplete_weights_fail_the_model_check(compose, layout, weights, expect):
    """An interrupted download: a zero-byte or cut file, or a shard the index names that never came."""
    import torch
    from safetensors.torch import save

    model = layout["model"]
    (model / "model.safetensors").unlink()
    whole = save({"w": torch.zeros(64)})
    for name, content in weights.items():
        if name == "index":
            index = {"weight_map": {f"t{i}": shard for i, shard in enumerate(content)}}
            (model / "model.safetensors.index.json").write_text(json.dumps(index))
            continue
        data = {"whole": whole, "truncated": whole[:-16]}.get(content, content)
        (model / name).write_bytes(data)
    rc, lines = run(compose(layout), FakeCluster())
    assert rc == 1 and re.search(expect, _fail_line(lines, "model")), lines


def test_a_model_folder_of_another_model_fails_the_config_check(compose, layout):
    """The 7B preset's launcher with a 32B model's config.json (a newcomer's wrong MODEL_PATH)."""
    config = {"model_type": "qwen2", "max_position_embeddings": 131072, "num_hidden_layers": 64,
              "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
              "vocab_size": 152064}  # fmt: skip
    (layout["model"] / "config.json").write_text(json.dumps(config))
    run_env = json.dumps({"name": "gtpo-qwen2.5-7b", "method": "gtpo", "model": "qwen2.5_7b", "adapter": None,
                          "changes": []})  # fmt: skip
    rc, lines = run(compose(layout), FakeCluster(), env={**GOOD_ENV, "GTPO_RUN": run_env})
    assert rc == 1, lines
    assert "describes Qwen2.5-32B: layers 64 (not 28)" in _fail_line(lines, "config")
    assert "but model=qwen2.5_7b is sized for Qwen2.5-7B" in _fail_line(lines, "config")


def test_wandb_without_key_or_offline_mode_fails(compose, layout):
    env = {k: v for k, v in GOOD_ENV.items() if k != "WANDB_MODE"}
    rc, lines = run(compose(layout), FakeCluster(), env=env)
    assert rc == 1 and "WANDB_API_KEY is unset" in _fail_line(lines, "trackers")
    rc, _ = run(compose(layout), FakeCluster(), env={**env, "WANDB_API_KEY": "k"})
    assert rc == 0


def test_relative_log_folders_are_warned_about(compose, layout):
    """file / tensorboard writing where verl's TaskRunner happens to start: a warn line, not a failure."""
    cfg = compose(layout, "trainer.logger=[console,file,tensorboard]")
    rc, lines = run(cfg, FakeCluster(), env={k: v for k, v in GOOD_ENV.items() if k != "VERL_FILE_LOGGER_ROOT"})
    assert rc == 0, "\n".join(lines)
    warns = [line for line in lines if " warn " in line]
    assert len(warns) == 2 and all(w.startswith("[preflight] warn trackers: trainer.logger has ") for w in warns)
    assert "file but VERL_FILE_LOGGER_ROOT unset (verl's default .) is relative" in warns[0]
    assert "tensorboard but TENSORBOARD_DIR unset (verl's default tensorboard_log/<project>/<experiment>)" in warns[1]
    assert lines.index(warns[0]) == ITEMS.index("trackers") + 1  # right after the trackers check
    # The launchers' folders under CKPTS_DIR: nothing to say.
    shared = {"VERL_FILE_LOGGER_ROOT": str(layout["ckpts"] / "logs"), "TENSORBOARD_DIR": str(layout["ckpts"] / "tb")}
    rc, lines = run(cfg, FakeCluster(), env={**GOOD_ENV, **shared})
    assert rc == 0 and not [line for line in lines if " warn " in line], "\n".join(lines)
    # VERL_FILE_LOGGER_PATH, when set, is the file logger's whole path.
    rc, lines = run(cfg, FakeCluster(), env={**GOOD_ENV, **shared, "VERL_FILE_LOGGER_PATH": "metrics.jsonl"})
    (warn,) = [line for line in lines if " warn " in line]
    assert "file but VERL_FILE_LOGGER_PATH=metrics.jsonl is relative" in warn
    # The Ray runtime env is what the TaskRunner sees: its absolute folder wins over a relative one here.
    runtime = "+ray_kwargs.ray_init.runtime_env.env_vars"
    cfg = compose(layout, "trainer.logger=[console,file]", f"{runtime}.VERL_FILE_LOGGER_ROOT=/shared/logs")
    rc, lines = run(cfg, FakeCluster(), env={**GOOD_ENV, "VERL_FILE_LOGGER_ROOT": "logs"})
    assert rc == 0 and not [line for line in lines if " warn " in line], "\n".join(lines)


def test_cpu_test_backend_on_a_gpu_run_fails_the_config_check(compose, layout):
    rc, lines = run(compose(layout), FakeCluster(), env={**GOOD_ENV, "VERL_PLATFORM": "cpu"})
    assert rc == 1
    assert "trainer.device=cuda but VERL_PLATFORM=cpu (the environment)" in _fail_line(lines, "config")


def test_unwritable_checkpoint_dir_fails(compose, layout, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, lines = run(compose(layout, f"trainer.default_local_dir={blocker}/ckpts"), FakeCluster())
    assert rc == 1 and f"trainer.default_local_dir={blocker}/ckpts" in _fail_line(lines, "checkpoint dir")


NOBODY = 65534  # another user's uid (the tests run as root, which may chown)


def _plant(folder: Path, mode: int, uid: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if uid is not None:
        os.chown(folder, uid, -1)
    folder.chmod(mode)
    return folder


@pytest.mark.parametrize(
    "make,expect",
    [
        (lambda t: _plant(t / "theirs", 0o700, NOBODY), f"owned by uid {NOBODY}, not by this user"),
        (lambda t: _plant(t / "group", 0o770), "mode 0770 lets group or others write into it"),
        (lambda t: _plant(t / "others", 0o757), "mode 0757 lets group or others write into it"),
        (lambda t: (t / "link").symlink_to(_plant(t / "real", 0o700)) or t / "link", "a symbolic link (to "),
    ],
    ids=["another-owner", "group-writable", "others-writable", "symlink"],
)
def test_checkpoint_dir_others_could_plant_files_in_fails(compose, layout, tmp_path, make, expect):
    """verl loads checkpoints with torch.load(weights_only=False): a folder others can write into, or someone else's,
    is refused; the line names the folder and what is wrong with it."""
    ckpts = make(tmp_path / "shared")
    existed = os.path.lexists(ckpts)
    rc, lines = run(compose(layout, f"trainer.default_local_dir={ckpts}"), FakeCluster())
    line = _fail_line(lines, "checkpoint dir")
    assert rc == 1 and f"trainer.default_local_dir={ckpts}: " in line and expect.format(t=tmp_path / "shared") in line
    assert os.path.lexists(ckpts) == existed and not list(ckpts.glob(".preflight-*"))  # nothing made there


@pytest.mark.parametrize("shared_mode", [0o1777, 0o2770], ids=["sticky", "project-group"])
def test_checkpoint_dir_under_a_shared_folder_is_made_private(compose, layout, tmp_path, shared_mode):
    """A missing folder under a shared one (a sticky scratch, a group project folder) is created private: made
    under the launchers' umask 077 it is 0700, and the line says so. (A folder swapped in by someone else later is
    theirs, which the check refuses.)"""
    sticky = _plant(tmp_path / "scratch", shared_mode)
    ckpts = sticky / "me" / "run"
    old = os.umask(0o077)  # process-wide: restored below
    try:
        rc, lines = run(compose(layout, f"trainer.default_local_dir={ckpts}"), FakeCluster())
    finally:
        os.umask(old)
    assert rc == 0, "\n".join(lines)
    mode = "2700" if shared_mode & 0o2000 else "0700"  # a setgid parent passes its setgid bit on (no write)
    assert f"[preflight] ok   checkpoint dir: {ckpts} writable, private (uid 0, mode {mode})" in lines
    assert (ckpts.stat().st_mode & 0o777, (sticky / "me").stat().st_mode & 0o777) == (0o700, 0o700)


def test_checkpoint_dir_under_a_folder_everyone_may_write_fails(compose, layout, tmp_path):
    """Under a folder everyone may write without the sticky bit anyone could rename the checkpoint folder away and
    put theirs in its place: the preflight refuses it as the driver and the trainer do before a resume (it passed
    here before and the run was refused after Ray and every worker had started), and makes nothing there."""
    scratch = _plant(tmp_path / "scratch", 0o777)
    ckpts = scratch / "me" / "run"
    rc, lines = run(compose(layout, f"trainer.default_local_dir={ckpts}"), FakeCluster())
    line = _fail_line(lines, "checkpoint dir")
    assert rc == 1 and f"trainer.default_local_dir={ckpts}: the folder above it, {scratch}, is writable" in line
    assert not (scratch / "me").exists()


@pytest.mark.parametrize(
    "cluster,overrides,expect",
    [
        (dict(n=2), [], "2 GPU node(s) ['gpu-a01', 'gpu-a02'] != trainer.nnodes=1"),
        (dict(n=1, gpus=4), [], "node gpu-a01 has 4 GPU(s) < trainer.n_gpus_per_node=8"),
        (dict(n=2, address="127.0.0.1"), ["trainer.nnodes=2"], "joined on loopback address 127.0.0.1"),
    ],
)
def test_cluster_size_and_addresses(compose, layout, cluster, overrides, expect):
    rc, lines = run(compose(layout, *overrides), FakeCluster(**cluster))
    assert rc == 1 and expect in _fail_line(lines, "ray cluster")


def test_two_node_cluster_passes(compose, layout):
    rc, lines = run(compose(layout, "trainer.nnodes=2"), FakeCluster(n=2))
    assert rc == 0, "\n".join(lines)


def test_gpu_less_head_has_no_driver_to_check(compose, layout):
    # The RayJob's head: no GPU, no nvidia-smi; the two GPU workers are checked.
    cluster = FakeCluster(n=3, node1={"gpus": 0, "driver": None})
    rc, lines = run(compose(layout, "trainer.nnodes=2"), cluster)
    assert rc == 0, "\n".join(lines)
    cluster = FakeCluster(n=3, node1={"gpus": 0, "driver": None}, node3={"driver": "570.86.15"})
    rc, lines = run(compose(layout, "trainer.nnodes=2"), cluster)
    assert rc == 1 and "node gpu-a03: NVIDIA driver 570.86.15" in _fail_line(lines, "driver")


def test_checkpoint_dir_not_shared_fails(compose, layout, tmp_path):
    local = tmp_path / "node-local"
    local.mkdir()
    rc, lines = run(compose(layout, "trainer.nnodes=2"), FakeCluster(n=2, unshared=(2, local)))
    assert rc == 1 and "node gpu-a02 reads" in _fail_line(lines, "checkpoint shared")


@pytest.mark.parametrize(
    "driver,expect", [("550.54.15", "NVIDIA driver 550.54.15 < 580"), (None, "no NVIDIA driver answered")]
)
def test_old_or_missing_driver_fails(compose, layout, driver, expect):
    cluster = FakeCluster(n=2, node2={"driver": driver})
    rc, lines = run(compose(layout, "trainer.nnodes=2"), cluster)
    assert rc == 1 and f"node gpu-a02: {expect}" in _fail_line(lines, "driver")


@pytest.mark.parametrize(
    "env,cluster,expect",
    [
        ({}, dict(n=2, node2={"interfaces": {}}), "node gpu-a02: interface ib0 has no IPv4 address"),
        ({"RAY_NETWORK_INTERFACE": "lo"}, dict(n=2, interfaces={"ib0": "10.0.0.1", "lo": "127.0.0.1"}), "lo has 127"),
        ({"GLOO_SOCKET_IFNAME": "^lo,docker"}, dict(n=2), "Gloo needs one interface name"),
    ],
)
def test_interfaces_fail(compose, layout, env, cluster, expect):
    rc, lines = run(compose(layout, "trainer.nnodes=2"), FakeCluster(**cluster), env={**GOOD_ENV, **env})
    assert rc == 1 and expect in _fail_line(lines, "interfaces")


# ------------------------------------------------------------------ separate_async: the rollout pool's nodes

SEPARATE = ["trainer=separate_async", "trainer.nnodes=2", "actor_rollout_ref.rollout.nnodes=1"]


@pytest.fixture
def cupy_importable(monkeypatch):
    """verl's NCCL checkpoint engine imports cupy; a stand-in module makes it importable on this CPU machine."""
    import types

    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))


def _items(lines):
    """(status, item) of every check line; the startup notes are printed as "[preflight] note ..." lines."""
    return [re.match(r"\[preflight\] (ok|FAIL) +([^:]+): ", line).groups() for line in lines if " note " not in line]


def test_separate_async_needs_trainer_plus_rollout_nodes(compose, layout, cupy_importable):
    """2 trainer nodes + a 1-node rollout pool: 3 GPU nodes pass, 2 (all of them the trainer's) fail naming the sum."""
    rc, lines = run(compose(layout, *SEPARATE), FakeCluster(n=3))
    assert rc == 0, "\n".join(lines)
    assert _items(lines[:-1]) == [("ok", item) for item in ITEMS]
    (cluster_line,) = [line for line in lines if " ray cluster: " in line]
    assert "2 GPU node(s) x >= 8 GPU(s) + rollout pool 1 x >= 8" in cluster_line
    # gtpo's batch scopes under parameter_sync_step=4 are a printed note, not a failure
    (note,) = [line for line in lines if " note " in line]
    assert "parameter_sync_step=4" in note and "32 prompts (512 responses), not the step's 128 (2048)" in note

    rc, lines = run(compose(layout, *SEPARATE), FakeCluster(n=2))
    assert rc == 1
    assert (
        "2 GPU node(s) ['gpu-a01', 'gpu-a02'] != trainer.nnodes=2 + actor_rollout_ref.rollout.nnodes=1 = 3"
        in (lines[-1])
    )
    assert lines[-1].startswith("[preflight] FAIL ray cluster: ")


def test_separate_async_rollout_nodes_need_their_gpus(compose, layout, cupy_importable):
    cluster = FakeCluster(n=3, node3={"gpus": 4})
    rc, lines = run(compose(layout, *SEPARATE), cluster)
    assert rc == 1 and "node gpu-a03 has 4 GPU(s) < actor_rollout_ref.rollout.n_gpus_per_node=8" in lines[-1]
    # a 4-GPU pool node is right when the pool asks for 4 GPUs per node (TP 1 replicas tile them)
    rc, lines = run(compose(layout, *SEPARATE, "actor_rollout_ref.rollout.n_gpus_per_node=4"), cluster)
    assert rc == 0, "\n".join(lines)


# One node's trainer of 4 GPUs and a one-node pool (its GPUs per node set by each test).
SPLIT = ["trainer=separate_async", "trainer.nnodes=1", "trainer.n_gpus_per_node=4",
         "actor_rollout_ref.rollout.nnodes=1"]  # fmt: skip


@pytest.mark.parametrize(
    "pool,cluster,overrides",
    [
        ("4", dict(n=1), []),  # verl's fully-async examples: one 8-GPU node, trainer 4 + pool 4
        ("4", dict(n=2), ["trainer.nnodes=2", "actor_rollout_ref.rollout.nnodes=2"]),  # 2 x (4 + 4)
    ],
    ids=["one-node", "two-nodes"],
)
def test_separate_async_pools_may_share_nodes_where_both_fit(compose, layout, cupy_importable, pool, cluster,
                                                               overrides):  # fmt: skip
    cfg = compose(layout, *SPLIT, f"actor_rollout_ref.rollout.n_gpus_per_node={pool}", *overrides)
    rc, lines = run(cfg, FakeCluster(**cluster))
    assert rc == 0, "\n".join(lines)
    (line,) = [line for line in lines if " ray cluster: " in line]
    nodes = cluster["n"]
    assert f"rollout pool {nodes} x 4 sharing {nodes} GPU node(s) of {[8] * nodes} GPU(s)" in line, line


@pytest.mark.parametrize(
    "pool,cluster,expect",
    [
        ("8", dict(n=1), "trainer 1 x 4 GPU(s) + rollout pool 1 x 8 GPU(s)"),  # 12 GPUs on one 8-GPU node
        ("4", dict(n=1, gpus=6), "on nodes of [6] GPU(s)"),  # 4 + 4 on a 6-GPU node
    ],
)
def test_separate_async_pools_that_do_not_fit_a_shared_node_fail(compose, layout, cupy_importable, pool, cluster,
                                                                   expect):  # fmt: skip
    cfg = compose(layout, *SPLIT, f"actor_rollout_ref.rollout.n_gpus_per_node={pool}")
    rc, lines = run(cfg, FakeCluster(**cluster))
    assert rc == 1 and lines[-1].startswith("[preflight] FAIL ray cluster: 1 GPU node(s) ['gpu-a01'] != ")
    assert "nor do they hold both pools side by side" in lines[-1] and expect in lines[-1], lines[-1]


def test_a_shared_node_splits_its_gpus_not_a_pools_node(compose, layout, cupy_importable):
    """Two 8-GPU nodes cannot hold a trainer of 1 x 4 beside a pool of 2 x 6 (each pool node's GPUs on one node:
    6 + 4 > 8), though 16 GPUs >= 16; three 2-GPU blocks fit one 8-GPU node."""
    cfg = compose(
        layout, *SPLIT[:3], "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=6"
    )
    rc, lines = run(cfg, FakeCluster(n=2))
    assert rc == 1 and "nor do they hold both pools side by side" in lines[-1]
    from gtpo.launch.preflight_cluster import _packs

    assert _packs([2, 2, 2], [8]) and not _packs([6, 6, 4], [8, 8]) and _packs([4, 4, 4, 4], [8, 8])


def test_nccl_engine_without_cupy_fails_the_config_check(compose, layout, monkeypatch):
    """cupy's import failure simulated: the config check names the backend, the module and verl's cupy pin."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    rc, lines = run(compose(layout, *SEPARATE), FakeCluster(n=3))
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith("[preflight] FAIL config: actor_rollout_ref.rollout.checkpoint_engine.backend=nccl")
    assert "imports cupy" in lines[0] and "install cupy-cuda13x==14.0.1" in lines[0]


def test_epochs_that_end_before_the_steps_fail_the_run_length(compose, layout):
    # The RayJob's former trainer.total_epochs=1: 17,290 // 128 = 135 of paper A's 210 steps, without a last checkpoint.
    rc, lines = run(compose(layout, "trainer.total_epochs=1"), FakeCluster())
    assert rc == 1
    fail = _fail_line(lines, "run length")
    assert "trainer.total_training_steps=210 but trainer.total_epochs=1 x 17290 // 128 = 135 steps" in fail
    assert "at least 2" in fail
    rc, lines = run(compose(layout, "trainer.total_epochs=2"), FakeCluster())
    assert rc == 0, "\n".join(lines)
    (line,) = [line for line in lines if " run length: " in line]
    assert "trainer.total_training_steps=210 (135 steps per epoch, total_epochs=2)" in line


def test_node_report_reads_token_and_loopback(tmp_path):
    from gtpo.launch.preflight import node_report

    token = tmp_path / "t"
    token.write_text("abc")
    report = node_report(str(token), ["lo", "no-such-if0"])
    assert report["token"] == "abc" and report["interfaces"] == {"lo": "127.0.0.1", "no-such-if0": None}
    assert node_report(str(tmp_path / "missing"), [])["token"].startswith("<unreadable")


@pytest.mark.e2e
def test_ray_cluster_reports_from_every_node(ray_session, ray_cluster, tmp_path):
    """The real Ray side: alive nodes listed, node_report pinned to each of them, the token read back."""
    from gtpo.launch.preflight import RayCluster, node_report

    cluster = RayCluster(ray_cluster.address)
    nodes = cluster.nodes()
    assert nodes and all(n["id"] and n["address"] for n in nodes)
    token = tmp_path / "token"
    token.write_text("xyz")
    reports = cluster.run_on_each(nodes, node_report, str(token), ["lo"])
    assert [r["token"] for r in reports] == ["xyz"] * len(nodes)
    assert all(r["interfaces"] == {"lo": "127.0.0.1"} for r in reports)


# ------------------------------------------------------------------ through the launch script (PREFLIGHT=1)


def _launch(tmp_path, size, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1" == -L ]]; then for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n'
        'else echo "${FAKE_DRIVER:-580.82.07}"; fi\n'
    )
    smi.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SUBMIT_", "WANDB_", "SLURM_", "GLOO_"))}
    env = {k: v for k, v in env.items() if not k.startswith(("NCCL_", "DRY_RUN", "PREFLIGHT"))}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        PYTHON=sys.executable,
        HOME=str(home),
        PREFLIGHT="1",
        WANDB_MODE="offline",
        RAY_DATA_HOME=str(tmp_path / "shared" / "verl"),
        PYTHONWARNINGS="ignore",
        **extra,
    )
    return subprocess.run(
        ["bash", str(REPO / "scripts" / f"run_gtpo_qwen2.5_{size}.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_launch_script_preflight_single_node(tmp_path):
    write_layout(tmp_path / "shared" / "verl")
    proc = _launch(tmp_path, "7b")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[preflight] OK: {len(ITEMS)} checks passed" in proc.stdout
    assert "models/Qwen2.5-7B (max_position_embeddings=131072" in proc.stdout
    assert "ray cluster: 1 GPU node(s) x >= 8 GPU(s)" in proc.stdout


def test_launch_script_preflight_old_driver(tmp_path):
    write_layout(tmp_path / "shared" / "verl")
    proc = _launch(tmp_path, "7b", FAKE_DRIVER="535.104.05")
    assert proc.returncode == 1
    assert "[preflight] FAIL driver: " in proc.stdout and "535.104.05 < 580" in proc.stdout


def test_launch_script_preflight_multi_node_needs_the_cluster(tmp_path):
    write_layout(tmp_path / "shared" / "verl", model_name="Qwen2.5-32B")
    proc = _launch(tmp_path, "32b")
    assert proc.returncode == 1
    assert "[preflight] FAIL ray cluster: trainer.nnodes=4 but RAY_ADDRESS is unset" in proc.stdout
