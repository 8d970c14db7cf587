"""The launchers under test: dry runs of scripts/run.sh and the published scripts/run_<method>_<model>.sh, fake
``ray`` / ``python`` tools that record how the launcher calls them, and the 7B launcher's arguments and environment
for a run on CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from tests.support.e2e import COIN_REWARD, REPO_ROOT

# The markers around the resolved config a dry run prints (gtpo/launch/dry_run.py).
BEGIN, END = "----- BEGIN RESOLVED CONFIG -----", "----- END RESOLVED CONFIG -----"
LAUNCHER = REPO_ROOT / "scripts" / "run_gtpo_qwen2.5_7b.sh"

# What a CPU run of :data:`LAUNCHER` sets beyond the backend preset: the demo's model (a 43-token vocabulary: a random
# model ends its responses at varying lengths, and a step trains in seconds), a 48-token response and 4 steps (the
# warm-up batch generated ahead, then trained on by the next step), and token budgets sized for a CPU.
CPU_ARGS = [
    "backend=cpu_tiny",
    "trainer.total_training_steps=4",
    "actor_rollout_ref.model.tokenizer_path=@TOKENIZER@",
    "data.max_response_length=48",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1024",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024",
    f"reward.custom_reward_function.path={COIN_REWARD}",
    "reward.custom_reward_function.name=compute_score",
    "algorithm.filter_groups.enable=false",
    # a slice of scale=dapo's sequence parallelism: each sequence split over the two ranks (Ulysses 2, one data-parallel
    # rank), through the CPU backend's Ulysses-aware SDPA
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
]


def script_path(method: str, size: str) -> Path:
    """The published ``scripts/run_<method>_qwen2.5_<size>.sh``."""
    return REPO_ROOT / "scripts" / f"run_{method}_qwen2.5_{size}.sh"


# A fake interpreter's first lines: the launcher itself (`-m gtpo.launch`) and inline scripts run for real.
REAL_LAUNCHER = f'if [[ "$1" == - || "$1 $2" == "-m gtpo.launch" ]]; then exec {sys.executable} "$@"; fi\n'


def dry_run_env(tmp: Path) -> dict[str, str]:
    """This process's environment for a launcher with ``DRY_RUN=1``, without the caller's Ray, job-submission and
    metric-logger settings, ``HOME`` at ``tmp``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RAY_", "SUBMIT_", "WANDB_", "VERL_FILE_LOGGER_")) and k != "TENSORBOARD_DIR"
    }
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        PYTHON=sys.executable,
        DRY_RUN="1",
        HOME=str(tmp),
        # Any ray.init() would try this unreachable address and fail: a dry run must never get there.
        RAY_ADDRESS="127.0.0.1:9",
        WANDB_MODE="disabled",
        PYTHONWARNINGS="ignore",
    )
    return env


def resolved_config(stdout: str) -> dict:
    """The resolved config a dry run printed between :data:`BEGIN` and :data:`END`."""
    if BEGIN not in stdout or END not in stdout:
        raise AssertionError(f"no resolved config in the dry-run output:\n{stdout[-3000:]}")
    return yaml.safe_load(stdout.split(BEGIN, 1)[1].split(END, 1)[0])


def fake_tools(tmp_path: Path) -> tuple[Path, Path]:
    """A fake `ray` (records argv and the runtime env it was handed) and a fake python (records argv; runs the
    launcher itself)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(
        "#!/usr/bin/env bash\n"
        'printf "ray %s\\n" "$*" >> "$FAKE_LOG"\n'
        'while [[ $# -gt 0 ]]; do [[ "$1" == --runtime-env ]] && cp "$2" "$FAKE_LOG.env"; shift; done\n'
    )
    (bin_dir / "fakepython").write_text(
        "#!/usr/bin/env bash\n" + REAL_LAUNCHER + 'printf "python %s\\n" "$*" >> "$FAKE_LOG"\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, log


def launcher_env(tmp: Path, assets, extra: dict[str, str]) -> dict[str, str]:
    """:func:`dry_run_env` for :data:`LAUNCHER` on one CPU node with ``assets`` (gtpo.cpu's tiny model and data)."""
    env = dry_run_env(tmp)
    env.update(
        NNODES="1", NGPUS_PER_NODE="1", MODEL_PATH=str(assets.model_dir), TRAIN_FILE=str(assets.train_parquet),
        TEST_FILE=str(assets.val_parquet), CKPTS_DIR=str(tmp / "ckpt"),
    )  # fmt: skip
    env.update(extra)
    return env


def cpu_args(assets) -> list[str]:
    """:data:`CPU_ARGS` with the tokenizer of ``assets``."""
    return [a.replace("@TOKENIZER@", str(assets.tokenizer_dir)) for a in CPU_ARGS]
