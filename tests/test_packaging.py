"""What the distributions carry: the ``gtpo`` wheel without the CPU test backend, ``gtpo-cpu`` with its vLLM plugin.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes, so a GPU install (the wheel, the
image) must register none of this repository's; the CPU environment (scripts/setup_env.sh) must. Both wheels are
built here from a copy of the sources (a few seconds each, no network):

    .venv/bin/python -m pytest -q tests/test_packaging.py -n0
"""

from __future__ import annotations

import configparser
import email
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_DIST = REPO / "requirements" / "gtpo-cpu"
PLUGIN = ("gtpo_cpu", "gtpo.cpu.vllm_patches:register")
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "gtpo", "recipe")
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")


def _build_wheel(src: Path, out: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def _copy_sources(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, dest / name, ignore=SKIP)
        else:
            shutil.copy2(REPO / name, dest / name)
    return dest


def _entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str
        parser.read_string(zf.read(name).decode())
    return {section: dict(parser[section]) for section in parser.sections()}


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(zf.read(name))


@pytest.fixture(scope="module")
def main_wheel(tmp_path_factory) -> Path:
    src = _copy_sources(tmp_path_factory.mktemp("gtpo-src"))
    return _build_wheel(src, tmp_path_factory.mktemp("gtpo-wheel"))


@pytest.fixture(scope="module")
def cpu_wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("gtpo-cpu-src") / "gtpo-cpu"
    shutil.copytree(CPU_DIST, src, ignore=SKIP)
    return _build_wheel(src, tmp_path_factory.mktemp("gtpo-cpu-wheel"))


def test_main_wheel_has_every_package_but_the_cpu_backend(main_wheel):
    with zipfile.ZipFile(main_wheel) as zf:
        names = zf.namelist()
    assert not [n for n in names if n.startswith("gtpo/cpu/")]
    packaged = {str(Path(n).parent) for n in names if n.endswith("/__init__.py")}
    in_checkout = {
        str(p.parent.relative_to(REPO))
        for top in ("gtpo", "recipe")
        for p in (REPO / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert "gtpo/cpu" in in_checkout
    assert packaged == in_checkout - {"gtpo/cpu"}
    configs = {f"recipe/gtpo/config/{p.name}" for p in (REPO / "recipe/gtpo/config").glob("*.yaml")}
    assert configs and configs <= set(names)


def test_main_wheel_registers_only_the_verl_plugin(main_wheel):
    assert _entry_points(main_wheel) == {"verl.plugins": {"gtpo": "gtpo.verl_plugin.register"}}


def test_cpu_distribution_is_metadata_with_the_vllm_plugin(cpu_wheel, main_wheel):
    with zipfile.ZipFile(cpu_wheel) as zf:
        assert all(".dist-info/" in n for n in zf.namelist()), zf.namelist()
    assert _entry_points(cpu_wheel) == {"vllm.general_plugins": {PLUGIN[0]: PLUGIN[1]}}
    meta, main = _metadata(cpu_wheel), _metadata(main_wheel)
    assert meta["Name"] == "gtpo-cpu"
    assert meta.get_all("Requires-Dist") == [f"gtpo=={main['Version']}"]
    # The plugin's target is the checkout's module, not anything the wheel holds.
    plugin = importlib.metadata.EntryPoint(name=PLUGIN[0], value=PLUGIN[1], group="vllm.general_plugins")
    register = plugin.load()
    assert callable(register) and Path(sys.modules[plugin.module].__file__) == REPO / "gtpo/cpu/vllm_patches.py"


def _dockerfile_check() -> str:
    """The Dockerfile's build-time check that the image carries no CPU test backend."""
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", "")
    (code,) = re.findall(r'python3 -I -c "(from importlib import metadata as md;[^"]*)"', text)
    return code


def _run_in(target: Path, code: str) -> subprocess.CompletedProcess:
    """``code`` in an interpreter that sees only the standard library and ``target``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(target)
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd=target)


def _install(wheels: list[Path], target: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(target)]
        + [str(w) for w in wheels],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def test_dockerfile_check_passes_on_the_wheel_and_fails_with_the_plugin(main_wheel, cpu_wheel, tmp_path):
    code = _dockerfile_check()
    gpu_install = _install([main_wheel], tmp_path / "gpu")
    assert not (gpu_install / "gtpo" / "cpu").exists() and (gpu_install / "gtpo" / "__init__.py").is_file()
    proc = _run_in(gpu_install, code)
    assert proc.returncode == 0, proc.stderr
    with_plugin = _install([main_wheel, cpu_wheel], tmp_path / "cpu")
    proc = _run_in(with_plugin, code)
    assert proc.returncode != 0 and "AssertionError: CPU test backend registered with vLLM" in proc.stderr


def test_dockerfile_check_fails_on_a_wheel_with_the_cpu_backend(tmp_path):
    src = _copy_sources(tmp_path / "src")
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    exclude = 'exclude = ["gtpo.cpu", "gtpo.cpu.*"]\n'
    assert text.count(exclude) == 1
    pyproject.write_text(text.replace(exclude, ""))
    wheel = _build_wheel(src, tmp_path / "wheel")
    proc = _run_in(_install([wheel], tmp_path / "site"), _dockerfile_check())
    assert proc.returncode != 0 and "AssertionError: gtpo/cpu installed" in proc.stderr


def test_image_and_gpu_setup_install_no_cpu_plugin():
    runs = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", "")
    installs = [step for step in re.split(r"&&|\n", runs) if "pip install" in step]
    assert any("/workspace/gtpo" in step for step in installs)
    assert not [step for step in installs if "gtpo-cpu" in step or "[cpu" in step]
    setup = (REPO / "scripts" / "setup_env.sh").read_text()
    gpu, cpu = re.search(r"^if has_gpu; then\n(.*?)^else\n(.*?)^fi\n", setup, re.M | re.S).groups()
    assert 'cpu_plugin="${repo_root}/requirements/gtpo-cpu"' in setup
    assert '"${pip[@]}" install --quiet -e ".[test,gpu]"' in gpu and "cpu_plugin" not in gpu
    assert re.search(r'install --quiet --no-deps -e \. "\$\{vllm_alias\}" "\$\{cpu_plugin\}"', cpu)
    assert '"${cpu_plugin}/pyproject.toml"' in setup  # a changed plugin package re-runs the setup


def test_this_environment_registers_the_plugin_only_on_cpu():
    """After scripts/setup_env.sh: on CPU exactly one gtpo_cpu plugin, from gtpo-cpu; with a GPU's vLLM, none."""
    found = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.value.startswith("gtpo")]
    try:
        cpu_env = importlib.metadata.version("vllm").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        cpu_env = False
    if cpu_env:
        assert [(ep.name, ep.value, ep.dist.name) for ep in found] == [(*PLUGIN, "gtpo-cpu")]
    else:
        assert found == []
    import gtpo.cpu

    assert Path(gtpo.cpu.__file__) == REPO / "gtpo" / "cpu" / "__init__.py"  # the editable checkout
