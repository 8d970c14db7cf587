"""The CPU backend at any world size the host can hold: the demo's batch arithmetic, the simulated nodes' commands,
and the config-time check that a world size divides the micro-batches (verl checks it only in the workers).

    .venv/bin/python -m pytest -q tests/test_world_size.py
"""

from __future__ import annotations

import os

import pytest

from gtpo.cpu import cluster
from gtpo.cpu.demo_trainer import BATCH_ROWS, MINI_BATCH_ROWS, world_overrides
from gtpo.launch.batch_checks import batch_plan
from tests.support.configs import compose

# The CPU backend cuts micro-batches by tokens (use_dynamic_bsz, as the model presets); the row-count checks need the
# fixed micro-batches back.
FIXED_MICRO_BATCHES = ["actor_rollout_ref.actor.use_dynamic_bsz=false"]


def _values(overrides: list[str]) -> dict[str, int]:
    return {k: int(v) for k, v in (o.split("=") for o in overrides)}


@pytest.mark.parametrize("nnodes,gpus", [(1, 1), (2, 1), (1, 2)])
def test_demo_packs_each_rank_share_into_token_budget_micro_batches(nnodes, gpus):
    """The demo trains as the presets do, with remove padding and dynamic batch sizes; each budget holds verl's
    128-token padding row; every rank's share of the old-log-prob pass takes several forwards even with every row at
    its shortest, and at one rank a mini-batch of the longest rows takes two micro-batches."""
    from verl.trainer.ppo.padding_utils import SYNTHETIC_PADDING_SEQ_LEN

    from gtpo.cpu.demo_task import build_tokenizer
    from gtpo.cpu.demo_trainer import (
        DEMO_SETTINGS,
        LOG_PROB_TOKEN_BUDGET,
        LONGEST_DEMO_SEQUENCE,
        MAX_SEQUENCE_TOKENS,
        MIN_SEQUENCE_TOKENS,
        TRAIN_TOKEN_BUDGET,
    )

    values = _values(world_overrides(nnodes, gpus))
    world = nnodes * gpus
    assert values == {"trainer.nnodes": nnodes, "trainer.n_gpus_per_node": gpus}
    cfg = compose(["backend=cpu_tiny", "method=gtpo", *DEMO_SETTINGS, *world_overrides(nnodes, gpus)])
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert actor.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz and cfg.actor_rollout_ref.model.use_remove_padding
    assert actor.ppo_max_token_len_per_gpu == TRAIN_TOKEN_BUDGET
    assert rollout.log_prob_max_token_len_per_gpu == cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu
    assert rollout.log_prob_max_token_len_per_gpu == LOG_PROB_TOKEN_BUDGET
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == MAX_SEQUENCE_TOKENS
    assert min(TRAIN_TOKEN_BUDGET, LOG_PROB_TOKEN_BUDGET) >= max(SYNTHETIC_PADDING_SEQ_LEN, MAX_SEQUENCE_TOKENS)
    prompt = build_tokenizer().apply_chat_template([{"role": "user", "content": "say 3"}], add_generation_prompt=True)
    prompt_tokens = len(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    assert (prompt_tokens + 1, prompt_tokens + cfg.data.max_response_length) == (
        MIN_SEQUENCE_TOKENS,
        LONGEST_DEMO_SEQUENCE,
    )
    assert BATCH_ROWS // world * MIN_SEQUENCE_TOKENS > LOG_PROB_TOKEN_BUDGET
    assert MINI_BATCH_ROWS * LONGEST_DEMO_SEQUENCE > TRAIN_TOKEN_BUDGET


def test_demo_refuses_a_world_size_that_does_not_divide_its_mini_batch():
    with pytest.raises(ValueError, match=r"3 x 1 = 3: the demo's mini-batch of 32 responses splits evenly only over"):
        world_overrides(3, 1)
    with pytest.raises(ValueError, match=r"gpus_per_node=0"):
        world_overrides(1, 0)


def test_a_demo_of_two_nodes_needs_a_cluster_and_says_how_to_start_one(tmp_path):
    from gtpo.cpu.demo import demo_command
    from gtpo.cpu.demo_task import build_demo_assets

    assets = build_demo_assets(seed=0)
    with pytest.raises(ValueError, match=r"python -m gtpo.cpu.cluster start --nodes 2"):
        demo_command(assets, "gtpo", 3, 0, tmp_path, [], nnodes=2)
    joined = demo_command(assets, "gtpo", 3, 0, tmp_path, [], "127.0.0.1:1", nnodes=2)
    assert "ray_kwargs.ray_init.num_gpus=null" in joined and "trainer.nnodes=2" in joined
    local = demo_command(assets, "gtpo", 3, 0, tmp_path, [], gpus_per_node=2)
    assert "ray_kwargs.ray_init.num_gpus=2" in local and "trainer.n_gpus_per_node=2" in local


@pytest.mark.parametrize("nnodes,gpus", [(1, 1), (2, 1), (1, 2)])
def test_the_backend_composes_at_each_world_size_and_passes_the_batch_check(nnodes, gpus):
    from gtpo.launch.checks import validate_recipe_config

    world = [f"trainer.nnodes={nnodes}", f"trainer.n_gpus_per_node={gpus}"]
    cfg = compose(["backend=cpu_tiny", "method=gtpo", *world])
    validate_recipe_config(cfg)
    # one logical GPU per rank of a local node
    assert cfg.ray_kwargs.ray_init.num_gpus == gpus


def test_the_trial_micro_batches_at_two_ranks_are_refused_before_ray_starts():
    """The demo's old settings (one micro-batch of 32 per mini-batch, log-prob passes of 128 rows) at two ranks:
    verl stopped in its workers; the recipe refuses at config time, naming the key and the share."""
    two = ["trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=16"]
    mini = ["actor_rollout_ref.actor.ppo_mini_batch_size=2", *FIXED_MICRO_BATCHES]
    cfg = compose(["backend=cpu_tiny", *two, *mini, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32"])
    with pytest.raises(ValueError, match=r"ppo_micro_batch_size_per_gpu=32 does not divide the 16 responses each rank"):
        batch_plan(cfg)
    cfg = compose(
        ["backend=cpu_tiny", *two, *mini, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128"]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"log_prob_micro_batch_size_per_gpu=128 does not divide the 64 responses"):
        batch_plan(cfg)
    # dynamic batch sizes cut by tokens, not rows: nothing to divide
    cfg = compose(
        ["backend=cpu_tiny", *two, *mini, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true"]
    )  # fmt: skip
    batch_plan(cfg)


def test_a_mini_batch_that_does_not_split_over_the_ranks_is_refused():
    cfg = compose(["backend=cpu_tiny", "trainer.nnodes=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    with pytest.raises(ValueError, match=r"= 8 responses per mini-batch do not split evenly over trainer.nnodes=3"):
        batch_plan(cfg)


def test_log_prob_share_counts_verl_padding_to_the_batch_multiple():
    # 3 prompts x 4 = 12 rows, mini-batch 8 rows, 2 ranks: verl pads to lcm(2, 8) = 8 -> 16 rows, 8 per rank
    cfg = compose(
        ["backend=cpu_tiny", *FIXED_MICRO_BATCHES, "trainer.n_gpus_per_node=2", "data.train_batch_size=3",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"]
    )  # fmt: skip
    batch_plan(cfg)
    cfg = compose(
        ["backend=cpu_tiny", *FIXED_MICRO_BATCHES, "trainer.n_gpus_per_node=2", "data.train_batch_size=3",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=6"]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"=6 does not divide the 8 responses"):
        batch_plan(cfg)


def test_node_commands_start_a_head_and_join_it():
    head = cluster.node_command(head_port=6391, head=True, gpus=1, temp_dir="/tmp/x", block=True)
    node = cluster.node_command(head_port=6391, head=False, gpus=2, temp_dir="/tmp/x1")
    assert head[1:3] == ["start", "--head"] and "--port=6391" in head and "--temp-dir=/tmp/x" in head
    assert "--block" in head and "--num-gpus=1" in head and "--node-ip-address=127.0.0.1" in head
    assert "--address=127.0.0.1:6391" in node and "--num-gpus=2" in node and "--head" not in node
    assert "--temp-dir=/tmp/x1" in node  # each node its own session folder: no log line forwarded twice
    with pytest.raises(ValueError, match=r"gpus=-1"):
        cluster.node_command(head_port=1, head=True, gpus=-1)


def test_raylets_get_the_cpu_platform_and_the_token_but_not_the_plugin_list(tmp_path):
    token = cluster.new_token(tmp_path)
    base = {"VERL_USE_EXTERNAL_MODULES": "x.y", "RAY_ADDRESS": "1.2.3.4:5", "PATH": "/bin", "RAY_AUTH_TOKEN": "v"}
    env = cluster.cluster_env(token, base)
    assert env["VERL_PLATFORM"] == "cpu" and env["PATH"] == "/bin"
    # the token by path (a value would show in every worker's environment), authentication never turned off
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(token) and "RAY_AUTH_TOKEN" not in env
    assert "VERL_USE_EXTERNAL_MODULES" not in env and "RAY_ADDRESS" not in env
    assert token.parent.stat().st_mode & 0o777 == 0o700 and token.stat().st_mode & 0o777 == 0o600
    # a second cluster in the same folder gets a new token, not the old one
    first = token.read_text()
    assert len(first) == 64 and cluster.new_token(tmp_path).read_text() != first


def test_the_cluster_folder_must_be_private(tmp_path, monkeypatch):
    """``/tmp/gtpo-ray-<port>`` is a predictable name: one planted by someone else (or left writable) is refused."""
    monkeypatch.setattr(cluster.tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / "gtpo-ray-6390"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    with pytest.raises(PermissionError, match=r"gtpo-ray-6390: mode 0777 lets group or others write"):
        cluster.start(nodes=1, port=6390)
    planted.chmod(0o755)
    os.chown(planted, 65534, 65534)
    if os.getuid() == 0:
        with pytest.raises(PermissionError, match=r"owned by uid 65534"):
            cluster.start(nodes=1, port=6390)


def test_cluster_cli_refuses_bad_sizes(capsys):
    assert cluster.main(["start", "--nodes", "0"]) == 1
    assert "nodes=0" in capsys.readouterr().err


def test_cluster_stop_ends_its_own_processes_and_nothing_else(monkeypatch, capsys, ray_host):
    """``python -m gtpo.cpu.cluster stop --port P`` ends the processes of the cluster ``start`` started on P (every
    process of its nodes' sessions that carries its token path) and removes its token; another Ray-named process of
    this user's, which ``ray stop`` would end too (it matches names such as ``raylet``), keeps running."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    short = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))  # Ray's socket paths must stay short
    monkeypatch.setattr(cluster.tempfile, "tempdir", str(short))
    port = cluster.free_port()
    bystander = subprocess.Popen(["bash", "-c", "exec -a raylet sleep 600"], start_new_session=True)
    try:
        _, token = cluster.start(nodes=1, port=port)
        processes = cluster.cluster_processes(token.parent.parent)
        assert len(processes) >= 3 and bystander.pid not in processes  # gcs, raylet, agents, ...
        assert cluster.stop(port, grace_s=2.0) == [port]  # Ray's daemons take ~10 s over a SIGTERM; then SIGKILL
        assert [pid for pid in processes if Path(f"/proc/{pid}").exists() and not cluster._is_zombie(pid)] == []
        assert not token.exists() and cluster.cluster_processes(token.parent.parent) == []
        assert bystander.poll() is None
        assert cluster.main(["stop"]) == 0  # nothing recorded is left
        assert (
            "no Ray cluster started by `python -m gtpo.cpu.cluster start` is recorded here" in capsys.readouterr().out
        )
    finally:
        cluster.stop(grace_s=2.0)
        bystander.kill()
        bystander.wait()
        shutil.rmtree(short, ignore_errors=True)
