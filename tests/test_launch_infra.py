"""The launcher on a cluster (gtpo/launch/submit.py): path rules, the job runtime env, preflight dispatch, the launch
environment.

    .venv/bin/pytest -q tests/test_launch_infra.py

A fake `ray` records `ray job submit` and keeps the runtime-env file it was handed; a fake python records its
arguments and the variables it was started with. Asserted: in job mode and under Slurm, paths under the submitter's
$HOME, relative paths and hub ids are refused before anything is submitted (ALLOW_HOME_PATHS=1 lifts the $HOME rule)
and the cluster-side paths are printed; the job's runtime env holds the file's variables, the plugin and the
variables ENV_PASSTHROUGH names, and nothing else (no tokens, no NCCL_* / GLOO_* / VLLM_* of the submitting
shell) plus the log folders; PREFLIGHT=1 starts the preflight module in both modes; every launch exports
HF_HUB_OFFLINE=1, TORCH_NCCL_AVOID_RECORD_STREAMS=1 and the metric-log folders under CKPTS_DIR.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.launch import REAL_LAUNCHER, fake_tools

REPO = Path(__file__).resolve().parents[1]
LOG_DIRS = ("VERL_FILE_LOGGER_ROOT", "TENSORBOARD_DIR", "WANDB_DIR")
RECORDED = ("HF_HUB_OFFLINE", "TORCH_NCCL_AVOID_RECORD_STREAMS", "VERL_USE_EXTERNAL_MODULES", *LOG_DIRS)


def script(method: str = "gtpo", size: str = "32b") -> Path:
    return REPO / "scripts" / f"run_{method}_qwen2.5_{size}.sh"


@pytest.fixture
def launch(tmp_path):
    bin_dir, log = fake_tools(tmp_path)  # the shared fake `ray`; the fake python below also records variables
    env_dump = " ".join(f"{v}=${{{v}-unset}}" for v in RECORDED)
    (bin_dir / "fakepython").write_text(
        "#!/usr/bin/env bash\n" + REAL_LAUNCHER + f'printf "python %s | {env_dump}\\n" "$*" >> "$FAKE_LOG"\n'
    )
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    token = tmp_path / "token"
    token.write_text("t" * 64)
    token.chmod(0o600)

    def run(path: Path, *args: str, **extra: str):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("RAY_", "SUBMIT_", "WANDB_", "DRY_RUN", "PREFLIGHT", "SLURM_", "ENV_PASSTHROUGH"))
            and k
            not in ("HF_HUB_OFFLINE", "TORCH_NCCL_AVOID_RECORD_STREAMS", "ALLOW_HOME_PATHS", "HF_TOKEN", *LOG_DIRS)
        }
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=str(bin_dir / "fakepython"), FAKE_LOG=str(log))
        env.update(
            HOME=str(home),
            WANDB_API_KEY="wandb-secret-123",
            HF_TOKEN="hf-secret-456",
            WANDB_PROJECT="gtpo-runs",
            NCCL_SOCKET_IFNAME="eno1",
            GLOO_SOCKET_IFNAME="eno1",
            VLLM_ATTENTION_BACKEND="XFORMERS",
        )
        # the cluster's Ray token, which job mode submits with (a test removes it with RAY_AUTH_TOKEN_PATH="")
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
        env.update(extra)
        proc = subprocess.run(["bash", str(path), *args], env=env, capture_output=True, text=True)
        calls = log.read_text().splitlines() if log.exists() else []
        runtime_env = yaml.safe_load(Path(f"{log}.env").read_text()) if Path(f"{log}.env").exists() else None
        return proc, calls, runtime_env

    run.home = home
    return run


JOB = {"RAY_ADDRESS": "http://head:8265"}


def recorded_env(call: str) -> dict[str, str]:
    """The variables the fake python was started with (RECORDED)."""
    return dict(item.split("=", 1) for item in call.split(" | ", 1)[1].split())


def log_dirs(ckpts: str) -> dict[str, str]:
    return {"VERL_FILE_LOGGER_ROOT": f"{ckpts}/logs", "TENSORBOARD_DIR": f"{ckpts}/tensorboard", "WANDB_DIR": ckpts}


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, "TRAIN_FILE={home}/verl/data/dapo_math_17k.parquet is under $HOME={home}"),
        ({"RAY_DATA_HOME": "/shared/verl", "CKPTS_DIR": "{home}/ckpts"}, "CKPTS_DIR={home}/ckpts is under $HOME"),
        ({"RAY_DATA_HOME": "/shared/verl", "TRAIN_FILE": "data/train.parquet"}, "TRAIN_FILE=data/train.parquet: not"),
        ({"RAY_DATA_HOME": "/shared/verl", "MODEL_PATH": "Qwen/Qwen2.5-32B"}, "MODEL_PATH=Qwen/Qwen2.5-32B: not an"),
        ({"RAY_DATA_HOME": "/shared/verl", "TEST_FILE": "[/shared/a.parquet,b.parquet]"}, "TEST_FILE=b.parquet: not"),
    ],
)
def test_job_mode_refuses_submitter_only_paths(launch, extra, message):
    extra = {k: v.format(home=launch.home) for k, v in extra.items()}
    proc, calls, _ = launch(script(), **JOB, **extra)
    assert proc.returncode != 0
    assert message.format(home=launch.home) in proc.stderr and "SUBMIT_MODE=job" in proc.stderr
    assert calls == []  # nothing submitted


def test_job_mode_with_shared_paths_submits_and_prints_them(launch):
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    call, exit_call = calls
    assert call.startswith("ray job submit --address http://head:8265 --submission-id gtpo_")
    # then the driver's own status, read back under that id (the CLI's status only as a fallback)
    job_id = call.split()[6]
    assert exit_call.startswith(f"python -m gtpo.launch.job_exit {job_id} --address http://head:8265 --cli-status 0 ")
    assert "paths the cluster will read" in proc.stderr
    assert "MODEL_PATH=/shared/verl/models/Qwen2.5-32B" in proc.stderr
    assert "actor_rollout_ref.model.path=/shared/verl/models/Qwen2.5-32B" in call


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"RAY_AUTH_TOKEN_PATH": ""}, "the cluster's dashboard wants its Ray token and RAY_AUTH_TOKEN_PATH is unset"),
        (
            {"RAY_AUTH_TOKEN_PATH": "/nonexistent/token"},
            "RAY_AUTH_TOKEN_PATH=/nonexistent/token: no readable token file here (No such file or directory)",
        ),
        ({"RAY_AUTH_TOKEN_PATH": "{tmp}"}, "RAY_AUTH_TOKEN_PATH={tmp}: not a file (mode drwx"),
        ({"RAY_AUTH_TOKEN_PATH": "{tmp}/shared-token"}, "RAY_AUTH_TOKEN_PATH={tmp}/shared-token: owned by uid"),
        ({"RAY_AUTH_MODE": "tokens"}, "RAY_AUTH_MODE=tokens: expected token or disabled"),
    ],
    ids=["unset", "missing", "a-folder", "readable-by-others", "bad-mode"],
)
def test_job_mode_submits_only_with_the_clusters_token(launch, tmp_path, extra, message):
    """`ray job submit` without the token would get the dashboard's 401 after uploading the working dir; a token
    file others may read (Ray's own generator writes 0644) is refused as well."""
    shared = tmp_path / "shared-token"
    shared.write_text("t" * 64)
    shared.chmod(0o644)
    extra = {k: v.format(tmp=tmp_path) for k, v in extra.items()}
    message = message.format(tmp=tmp_path)
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl", **extra)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert calls == []  # nothing submitted


def test_job_mode_exports_the_token_mode_and_an_explicit_knob_turns_it_off(launch, tmp_path):
    (tmp_path / "bin" / "ray").write_text(
        '#!/usr/bin/env bash\nprintf "ray mode=%s path=%s\\n" "${RAY_AUTH_MODE-unset}" "${RAY_AUTH_TOKEN_PATH-unset}"'
        ' >> "$FAKE_LOG"\n'
    )
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl", RAY_AUTH_MODE="")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert calls[0] == f"ray mode=token path={tmp_path / 'token'}"  # unset mode: token, exported to the CLI
    assert (tmp_path / "token").read_text() not in proc.stderr + proc.stdout  # the value is never printed
    (tmp_path / "calls.log").unlink()
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl", RAY_AUTH_MODE="disabled")
    assert proc.returncode == 0 and "RAY_AUTH_MODE=disabled: submitting without Ray's token" in proc.stderr
    assert calls[0] == f"ray mode=disabled path={tmp_path / 'token'}"


def test_job_mode_hands_the_cli_status_on_and_no_wait_names_the_job(launch, tmp_path):
    """The CLI's own status reaches the exit-status helper (its fallback); with JOB_NO_WAIT=1 nothing has ended yet:
    the launch prints the job's id and how to follow it. (tests/test_job_exit.py runs both against a real Ray.)"""
    (tmp_path / "bin" / "ray").write_text('#!/usr/bin/env bash\nprintf "ray %s\\n" "$*" >> "$FAKE_LOG"\nexit 1\n')
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl")
    submit, exit_call = calls
    assert " --cli-status 1 " in exit_call and exit_call.split()[3] == submit.split()[6]
    (tmp_path / "calls.log").unlink()
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl", JOB_NO_WAIT="1")
    (submit,) = calls
    job_id = submit.split()[6]
    assert proc.returncode == 1 and " --no-wait " in submit
    assert f"[gtpo] job {job_id} submitted: ray job logs --address http://head:8265 {job_id} --follow" in proc.stderr


def test_allow_home_paths_lifts_the_home_rule_only(launch):
    proc, calls, _ = launch(script(), **JOB, ALLOW_HOME_PATHS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(calls) == 2  # ray job submit, then the driver's status
    proc, calls, _ = launch(script(), **JOB, ALLOW_HOME_PATHS="1", MODEL_PATH="Qwen/Qwen2.5-32B")
    assert proc.returncode != 0 and "not an absolute path" in proc.stderr


def test_slurm_driver_refuses_home_paths(launch):
    proc, calls, _ = launch(script("dapo", "7b"), SLURM_JOB_ID="77", RAY_ADDRESS="10.0.0.1:6379")
    assert proc.returncode != 0 and "on a cluster (SLURM_JOB_ID=77)" in proc.stderr and calls == []
    proc, calls, _ = launch(script("dapo", "7b"), SLURM_JOB_ID="77", RAY_ADDRESS="10.0.0.1:6379", RAY_DATA_HOME="/lus")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert calls[0].startswith("python -m recipe.gtpo.main_gtpo ")
    # The driver attached to the Slurm cluster has the log folders on shared storage (and hands them to Ray).
    env = recorded_env(calls[0])
    assert {k: env[k] for k in LOG_DIRS} == log_dirs("/lus/ckpts/gtpo-reproduction/dapo-qwen2.5-7b")


def test_single_node_keeps_the_home_default(launch):
    proc, calls, _ = launch(script("dapo", "7b"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"data.train_files={launch.home}/verl/data/dapo_math_17k.parquet" in calls[0]
    assert f"actor_rollout_ref.model.path={launch.home}/verl/models/Qwen2.5-7B" in calls[0]


def test_runtime_env_holds_only_named_variables(launch):
    proc, calls, runtime_env = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = yaml.safe_load((REPO / "recipe" / "gtpo" / "runtime_env.yaml").read_text())["env_vars"]
    # The file's variables, the plugin, the log folders, and the default ENV_PASSTHROUGH names this shell has set.
    named = {"VERL_USE_EXTERNAL_MODULES", "WANDB_PROJECT", "HF_HUB_OFFLINE", "GTPO_RUN", *LOG_DIRS}
    assert set(runtime_env["env_vars"]) == set(base) | named
    assert runtime_env["env_vars"]["WANDB_PROJECT"] == "gtpo-runs" and runtime_env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    ckpts = "/shared/verl/ckpts/gtpo-reproduction/gtpo-qwen2.5-32b"
    assert {k: runtime_env["env_vars"][k] for k in LOG_DIRS} == log_dirs(ckpts)
    text = yaml.safe_dump(runtime_env)
    for leaked in ("wandb-secret-123", "hf-secret-456", "eno1", "XFORMERS"):
        assert leaked not in text


def test_explicitly_named_secret_is_copied_with_a_warning(launch):
    proc, _, runtime_env = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl", ENV_PASSTHROUGH="WANDB_API_KEY")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert runtime_env["env_vars"]["WANDB_API_KEY"] == "wandb-secret-123"
    assert "WANDB_API_KEY is stored with the job" in proc.stderr and "wandb-secret-123" not in proc.stderr


def test_prefix_copying_is_refused(launch):
    proc, calls, _ = launch(script(), **JOB, RAY_DATA_HOME="/shared/verl", ENV_PASSTHROUGH_PREFIXES="NCCL_")
    assert proc.returncode != 0 and "prefix copying is gone" in proc.stderr and calls == []


@pytest.mark.parametrize("extra", [{}, {**JOB, "RAY_DATA_HOME": "/shared/verl"}])
def test_preflight_runs_the_preflight_module(launch, extra):
    proc, calls, _ = launch(script("gtpo", "7b"), PREFLIGHT="1", **extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    call = calls[0]
    module = call.split(" -m ", 1)[1].split()[0]
    assert module == "gtpo.launch.preflight"
    assert "method=gtpo" in call and "model=qwen2.5_7b" in call


def test_local_launch_environment(launch):
    proc, calls, _ = launch(script("grpo", "7b"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = recorded_env(calls[0])
    assert env["HF_HUB_OFFLINE"] == "1" and env["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"
    assert "gtpo.verl_plugin.register" in env["VERL_USE_EXTERNAL_MODULES"]
    assert {k: env[k] for k in LOG_DIRS} == log_dirs(f"{launch.home}/verl/ckpts/gtpo-reproduction/grpo-qwen2.5-7b")
    # A user's own choice wins.
    proc, calls, _ = launch(script("grpo", "7b"), HF_HUB_OFFLINE="0", TENSORBOARD_DIR="/elsewhere/tb")
    env = recorded_env(calls[-1])
    assert env["HF_HUB_OFFLINE"] == "0" and env["TENSORBOARD_DIR"] == "/elsewhere/tb"


def test_driver_hands_its_log_folders_to_ray(monkeypatch):
    """recipe/gtpo/main_gtpo.py: on a running cluster the TaskRunner sees ray.init's runtime env, not the driver's
    shell; a folder the config's runtime env sets already stays."""
    from omegaconf import OmegaConf

    from recipe.gtpo.main_gtpo import forward_log_dirs

    cfg = OmegaConf.create({"ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {"TENSORBOARD_DIR": "/cfg/tb"}}}}})
    OmegaConf.set_struct(cfg, True)  # as Hydra composes it
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", "/shared/ckpts/logs")
    monkeypatch.setenv("TENSORBOARD_DIR", "/shared/ckpts/tensorboard")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    forward_log_dirs(cfg)
    env_vars = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env_vars == {"TENSORBOARD_DIR": "/cfg/tb", "VERL_FILE_LOGGER_ROOT": "/shared/ckpts/logs"}
    # verl's own config has a runtime env without env_vars: the block is made, and what goes into it stays
    cfg = OmegaConf.create({"ray_kwargs": {"ray_init": {"runtime_env": {"py_executable": None}}}})
    OmegaConf.set_struct(cfg, True)
    forward_log_dirs(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_ROOT == "/shared/ckpts/logs"
