"""The README's cluster path, walked in order on a machine without Docker, internet, GPUs or Slurm.

    .venv/bin/python -m pytest -q tests/test_newcomer_path.py

The ```bash block under "## From an empty cluster to a running job" is parsed out of README.md and every command in
it is checked as far as this machine allows, so a README edit that breaks a command breaks this test:

* ``docker build``: the Dockerfile it names exists (its build checks and lint: tests/test_dockerfile.py);
* ``enroot import``: nothing to run here;
* ``export RAY_DATA_HOME=...``: a temporary folder stands in for the shared one;
* ``python -m gtpo.data.prepare``: run as written, with the offline copies in ../shared/data for ``--hf``'s hub sets;
* ``hf download``: run as written with ``--help`` appended (the CLI parses every option and downloads nothing); the
  ``--local-dir`` it names then gets the ``config.json`` a dry run reads;
* the dry runs: run as written in a fresh shell (``PATH=/usr/bin:/bin``, no ``PYTHON``, no environment activated),
  in a copy of the checkout that holds no new file afterwards (Hydra used to leave ``outputs/<date>/<time>/``); they
  must find the data and the models the steps above made;
* a GPU run: the launcher exists (its dry run is above);
* ``sbatch``: parses, names files that exist and variables the sbatch reads (what it does: tests/test_slurm.py).

A copy, not the checkout itself: other work in the checkout (editors, other tests) must not fail the file check.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from gtpo.launch.preflight_checks import check_trackers
from gtpo.launch.submit import DEFAULT_PASSTHROUGH

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SECTION = "## From an empty cluster to a running job"
BEGIN, END = "----- BEGIN RESOLVED CONFIG -----", "----- END RESOLVED CONFIG -----"
# A vocabulary no preset assumes (Qwen2.5's is 152,064): the dry run's memory line shows it read the faked model.
FAKE_VOCAB = 151_000
# Stands in for `<hf> download ...`: the command as written with --help (options parsed, nothing downloaded), then
# the config.json a dry run reads in the --local-dir it names; `set -e`: a loop's status is only its last command's.
HF_CHECK = r"""
set -e
hf_check() {
    "$@" --help >/dev/null || return
    local arg dir="" prev=""
    for arg in "$@"; do
        [[ "${prev}" == --local-dir ]] && dir=${arg}
        [[ "${arg}" == --local-dir=* ]] && dir=${arg#*=}
        prev=${arg}
    done
    [[ -n "${dir}" ]] || { echo "no --local-dir in: $*" >&2; return 1; }
    mkdir -p "${dir}" && echo "{\"vocab_size\": ${FAKE_VOCAB}}" > "${dir}/config.json"
}
"""


def readme_commands() -> list[str]:
    """The commands of the README's cluster block, continuation lines joined, comment lines dropped."""
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    block = text.split(SECTION, 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    commands, pending = [], ""
    for line in block.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        pending += line.removesuffix("\\")
        if not line.endswith("\\"):
            commands.append(" ".join(pending.split()))
            pending = ""
    return commands


def copy_checkout(dst: Path) -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore) with its .venv linked in."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode:
        pytest.skip(f"not a git checkout: {listed.stderr.strip()}")
    for rel in filter(None, listed.stdout.split("\0")):
        src = REPO / rel
        if src.is_file():  # a deleted file is still listed until it is committed
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    (dst / ".venv").symlink_to(REPO / ".venv")
    return dst


def tree(root: Path) -> set[str]:
    """Every file and folder under ``root`` but the linked .venv and Python's bytecode caches."""
    found = set()
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not (top == str(root) and d == ".venv")]
        rel = Path(top).relative_to(root)
        found.update(str(rel / name) for name in dirs + files)
    return found


def run(cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def resolved_configs(stdout: str) -> list[dict]:
    return [yaml.safe_load(block.split(END, 1)[0]) for block in stdout.split(BEGIN)[1:]]


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").is_file(), reason="no .venv: bash scripts/setup_env.sh")
@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"no offline data sets in {SHARED_DATA}")
def test_the_readme_cluster_block_runs_as_written(tmp_path):
    checkout = copy_checkout(tmp_path / "checkout")
    before = tree(checkout)
    home = tmp_path / "home"
    home.mkdir()
    # A fresh login shell: no virtual environment on PATH, no PYTHON, nothing of this process's environment.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    steps: list[str] = []
    launched: list[str] = []
    job_configs: list[dict] = []  # the resolved config of each launcher's dry run, in order
    for cmd in readme_commands():
        words = shlex.split(cmd, comments=True)
        if words[0] == "docker":
            steps.append("image")
            assert words[1] == "build" and (checkout / words[words.index("-f") + 1]).is_file(), cmd
        elif words[0] == "enroot":
            steps.append("image")
            assert words[1] == "import", cmd
        elif words[0] == "export":
            steps.append("export")
            name, _, value = words[1].partition("=")
            assert name == "RAY_DATA_HOME" and value.startswith("/"), cmd
            env[name] = str(tmp_path / value.lstrip("/"))
        elif "gtpo.data.prepare" in words:
            steps.append("data")
            hub = re.search(r"--hf((?: (?!-)[\w.-]+)+)", cmd)
            assert hub, f"no --hf data set: {cmd}"
            files = [SHARED_DATA / f"{name}.jsonl" for name in hub.group(1).split()]
            assert all(f.is_file() for f in files), files
            proc = run(cmd.replace(hub.group(0), " ".join(["--input", *map(str, files)])), checkout, env)
            assert proc.returncode == 0, f"{cmd}\n{proc.stderr[-3000:]}"
        elif "download" in words:
            steps.append("models")
            hf = re.search(r"(\S*\bhf|\S*huggingface-cli) download", cmd)
            assert hf, f"no `hf download` in: {cmd}"
            check_env = {**env, "HF_HUB_OFFLINE": "1", "FAKE_VOCAB": str(FAKE_VOCAB)}
            proc = run(HF_CHECK + cmd.replace(hf.group(0), f"hf_check {hf.group(0)}"), checkout, check_env)
            assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        elif "DRY_RUN=1" in words:
            steps.append("dry run")
            # `a && b`: both dry runs at once (each as written), to halve the wait
            parts = [part.strip() for part in cmd.split("#", 1)[0].split("&&")]
            with ThreadPoolExecutor(max_workers=len(parts)) as pool:
                procs = list(pool.map(lambda part: run(part, checkout, env), parts))
            for part, proc in zip(parts, procs, strict=True):
                out = proc.stdout + proc.stderr
                assert proc.returncode == 0, f"{part}\n{out[-4000:]}"
                configs = resolved_configs(proc.stdout)
                assert configs and proc.stdout.count("[dry run] OK") == len(configs), part
                for cfg in configs:
                    # what the steps above wrote is what the launcher reads
                    data = cfg["data"]
                    for path in [data["train_files"], *data["val_files"]]:
                        assert Path(path).is_file() and path.startswith(env["RAY_DATA_HOME"]), (part, path)
                    model = Path(cfg["actor_rollout_ref"]["model"]["path"])
                    assert f"vocabulary {FAKE_VOCAB:,}: vocab_size of {model / 'config.json'}" in proc.stdout, part
                launched.append(shlex.split(part)[-1])
                job_configs.append(configs[-1])
        elif "sbatch" in words:
            steps.append("sbatch")
            at = words.index("sbatch")
            sbatch = checkout / next(w for w in words[at + 1 :] if not w.startswith("-"))
            assert sbatch.is_file() and subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0, cmd
            text = sbatch.read_text()
            for assignment in words[:at]:
                name, _, value = assignment.partition("=")
                if name in DEFAULT_PASSTHROUGH.split():  # the launcher hands these to Ray's runtime env
                    continue
                assert re.search(rf"\$\{{{name}[:}}]", text), f"{sbatch.name} does not read {name}"
                if name == "LAUNCH_SCRIPT":
                    assert value in launched, f"{value} is launched before its dry run"
            # the job's preflight passes its tracker check with what the line sets (W&B offline, or a key)
            job_env = {**env, **dict(a.partition("=")[::2] for a in words[:at])}
            assert check_trackers(OmegaConf.create(job_configs[-1]), job_env).startswith("wandb ("), cmd
        elif words[0] == "bash":
            steps.append("gpu run")
            assert words[1] in launched, f"{cmd}: no dry run of it above"
        else:
            pytest.fail(f"README.md's cluster block has a command this test does not check: {cmd}")
    # in this order, each step once or more
    assert list(dict.fromkeys(steps)) == ["image", "export", "data", "models", "dry run", "gpu run", "sbatch"], steps
    assert launched == ["scripts/run_smoke_qwen2.5_0.5b.sh", "scripts/run_gtpo_qwen2.5_32b.sh"]
    assert tree(checkout) == before, f"left in the checkout: {sorted(tree(checkout) - before)}"
