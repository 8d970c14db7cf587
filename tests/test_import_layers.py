"""The house's layers, by the import graph: no arrow runs back up (docs: "Readers below writers").

    .venv/bin/python -m pytest -q tests/test_import_layers.py

The graph is read from the source (every ``import`` statement of every module in ``gtpo/``, including the ones inside
functions, which run later and are still arrows), then followed transitively: importing ``gtpo.a.b`` also runs
``gtpo/__init__.py`` and ``gtpo/a/__init__.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gtpo"


def _module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


MODULES = _module_files()


def _imported_names(module: str) -> set[str]:
    """Every dotted name ``module`` imports (``from a import b`` gives ``a`` and ``a.b``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def reachable(module: str) -> set[str]:
    """The modules of ``gtpo`` and the outside names that importing ``module`` can import, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in _imported_names(todo.pop()):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in MODULES and prefix not in seen:
                    seen.add(prefix)
                    todo.append(prefix)
            if parts[0] != "gtpo":
                seen.add(name)
    return seen


def _under(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


# (modules under this package, what they must never reach): the "Never" list of the architecture, and viz below the
# verl adapter.
RULES = [
    ("gtpo.viz", ("gtpo.verl_plugin",)),
    ("gtpo.metric_log", ("gtpo.verl_plugin", "gtpo.viz", "gtpo.cpu", "verl")),
    ("gtpo.algorithms", ("verl", "ray", "vllm", "omegaconf")),
    ("gtpo.reward", ("gtpo.algorithms",)),
]


@pytest.mark.parametrize("package,forbidden", RULES, ids=[r[0] for r in RULES])
def test_no_arrow_runs_back_up(package, forbidden):
    modules = sorted(m for m in MODULES if _under(m, (package,)))
    assert modules, f"no module under {package}"
    arrows = {m: sorted(n for n in reachable(m) if _under(n, forbidden)) for m in modules}
    assert {m: a for m, a in arrows.items() if a} == {}


def test_only_the_cpu_corner_imports_it():
    """Nothing but ``gtpo.cpu`` itself imports ``gtpo.cpu`` (tests, demos and the CPU preset live outside ``gtpo``)."""
    importers = {m for m in MODULES if not _under(m, ("gtpo.cpu",)) and any(
        _under(n, ("gtpo.cpu",)) for n in _imported_names(m)
    )}  # fmt: skip
    assert importers == set()


def test_the_graph_sees_lazy_imports():
    """The reader finds an import inside a function (how the trainer reaches the picture layer)."""
    assert "gtpo.viz.dump_writer" in reachable("gtpo.verl_plugin.trainer_mixin")
    assert "matplotlib.figure" in reachable("gtpo.viz.curves")


def test_importing_the_picture_layer_loads_no_verl_adapter():
    code = (
        "import sys, gtpo.viz, gtpo.viz.curves, gtpo.viz.tracker, gtpo.viz.tokens, gtpo.viz.__main__, gtpo.metric_log\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('gtpo.verl_plugin', 'verl')))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
