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
    ("gtpo.viz", ("gtpo.verl_plugin", "gtpo.trainer", "gtpo.launch")),
    ("gtpo.metric_log", ("gtpo.verl_plugin", "gtpo.trainer", "gtpo.launch", "gtpo.viz", "gtpo.cpu", "verl")),
    # the method table sits below everything that reads it
    ("gtpo.methods", ("gtpo.trainer", "gtpo.launch", "gtpo.verl_plugin")),
    # the trainer's runtime: never the registration (which imports it) nor the launch tooling
    ("gtpo.trainer", ("gtpo.verl_plugin.register", "gtpo.launch")),
    ("gtpo.algorithms", ("verl", "ray", "vllm", "omegaconf")),
    ("gtpo.reward", ("gtpo.algorithms",)),
]


@pytest.mark.parametrize("package,forbidden", RULES, ids=[r[0] for r in RULES])
def test_no_arrow_runs_back_up(package, forbidden):
    modules = sorted(m for m in MODULES if _under(m, (package,)))
    assert modules, f"no module under {package}"
    arrows = {m: sorted(n for n in reachable(m) if _under(n, forbidden)) for m in modules}
    assert {m: a for m, a in arrows.items() if a} == {}


def test_the_knob_reader_imports_nothing_of_the_recipe():
    """``gtpo.knobs`` (one block into its dataclass) is the floor every room stands on."""
    assert sorted(n for n in reachable("gtpo.knobs") if _under(n, ("gtpo", "verl"))) == []


def test_the_trainer_reaches_the_adapters_only_for_the_actor_loss():
    """Of the adapters verl calls, the trainer imports the actor loss it installs in the workers, and nothing else."""
    reached = {
        n for m in MODULES if _under(m, ("gtpo.trainer",)) for n in reachable(m) if _under(n, ("gtpo.verl_plugin",))
    }
    assert reached == {"gtpo.verl_plugin", "gtpo.verl_plugin.actor_loss"}


def test_the_adapters_reach_neither_the_runtime_nor_the_tooling():
    """What verl calls (estimators, losses) stands alone; only ``register``, the one module above both rooms, reaches
    the trainer modes (to register them)."""
    adapters = sorted(m for m in MODULES if _under(m, ("gtpo.verl_plugin",)) and m != "gtpo.verl_plugin.register")
    arrows = {m: sorted(n for n in reachable(m) if _under(n, ("gtpo.trainer", "gtpo.launch"))) for m in adapters}
    assert {m: a for m, a in arrows.items() if a} == {}
    assert "gtpo.trainer.modes" in reachable("gtpo.verl_plugin.register")


def test_only_the_registration_imports_the_trainer_modes():
    """Importing :mod:`gtpo.trainer.modes` registers the trainers into verl: one module does it, the launch checks read
    the modes' names from :mod:`gtpo.trainer.mode_names`."""
    importers = {m for m in MODULES if "gtpo.trainer.modes" in _direct_arrows(m)}
    assert importers == {"gtpo.verl_plugin.register"}


def test_only_the_cpu_corner_imports_it():
    """Nothing but ``gtpo.cpu`` itself imports ``gtpo.cpu`` (tests, demos and the CPU preset live outside ``gtpo``)."""
    importers = {m for m in MODULES if not _under(m, ("gtpo.cpu",)) and any(
        _under(n, ("gtpo.cpu",)) for n in _imported_names(m)
    )}  # fmt: skip
    assert importers == set()


def test_the_graph_sees_lazy_imports():
    """The reader finds an import inside a function (how the trainer reaches the picture layer)."""
    assert "gtpo.viz.dump_writer" in reachable("gtpo.trainer.observe.hooks")
    assert "matplotlib.figure" in reachable("gtpo.viz.curves")


def test_importing_the_picture_layer_loads_no_verl_adapter():
    code = (
        "import sys, gtpo.viz, gtpo.viz.curves, gtpo.viz.tracker, gtpo.viz.tokens, gtpo.viz.__main__, gtpo.metric_log\n"
        "rooms = ('gtpo.verl_plugin', 'gtpo.trainer', 'gtpo.launch', 'verl')\n"
        "bad = sorted(m for m in sys.modules if m.startswith(rooms))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _direct_arrows(module: str) -> set[str]:
    """The modules of ``gtpo`` that ``module`` imports (``from a import b``: ``a.b`` if a module, else ``a``)."""
    arrows = set()
    for name in _imported_names(module):
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            arrows.add(name)
    return arrows


def import_circles() -> list[list[str]]:
    """Every set of modules that import each other, directly or around a circle (Tarjan's strongly connected
    components of the import graph; lazy imports count, the parent packages an import runs do not)."""
    graph = {m: _direct_arrows(m) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(start: str) -> None:  # iterative, so a deep chain cannot reach the recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    circles.append(sorted(part))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circle():
    """No module of ``gtpo`` reaches itself through its imports: a reader can take the modules in one order."""
    assert import_circles() == []


def test_the_circle_check_sees_a_circle(monkeypatch):
    arrows = {"gtpo.a": {"gtpo.b"}, "gtpo.b": {"gtpo.c"}, "gtpo.c": {"gtpo.a"}, "gtpo.d": {"gtpo.a"}}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", dict.fromkeys(arrows, PACKAGE))
    monkeypatch.setattr(sys.modules[__name__], "_direct_arrows", arrows.__getitem__)
    assert import_circles() == [["gtpo.a", "gtpo.b", "gtpo.c"]]
