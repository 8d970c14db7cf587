"""The tests' own layout: no test module imports another test module; what several share lives in tests/support/.

    .venv/bin/python -m pytest -q tests/test_test_layout.py

A test module imported by another is loaded under two roles, and its private helpers become an interface nobody
sees: every import statement of every module under tests/ (at any depth, inside functions too) is read with ``ast``
and must not name a ``test_*`` module of tests/.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(module: str) -> bool:
    """``tests.test_x`` (or below), or ``test_x`` bare where tests/test_x.py exists (tests/ on ``sys.path``)."""
    parts = module.split(".")
    if parts[0] == "tests":
        return any(part.startswith("test_") for part in parts[1:])
    return parts[0].startswith("test_") and (TESTS / f"{parts[0]}.py").is_file()


def imported_test_modules(source: str, package: str = "tests") -> list[str]:
    """The test modules that ``source``, a module of ``package``, imports, as ``"line: module"``; relative imports
    resolved against ``package``, ``from P import name`` checked as ``P.name`` too (``name`` may be a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                module = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if _is_test_module(module):
                found.append(f"{node.lineno}: {module}")
            else:
                found += [
                    f"{node.lineno}: {module}.{a.name}" for a in node.names if _is_test_module(f"{module}.{a.name}")
                ]
    return sorted(found, key=lambda entry: int(entry.split(":")[0]))


def test_the_check_sees_every_form_of_import():
    source = "\n".join(
        [
            "from tests.test_configs import compose",  # 1
            "from tests import test_forking",  # 2
            "from .test_dry_run import complete_checkpoint",  # 3
            "from . import conftest, test_viz_tokens as viz",  # 4
            "import tests.test_e2e_trainer",  # 5
            "def f():",  # 6
            "    from tests.test_launch_scripts import fake_tools",  # 7
            "from tests.support.e2e import run_recipe",  # 8: allowed
            "from tests.conftest import REPO_ROOT",  # 9: allowed
            "import test_configs",  # 10: tests/test_configs.py with tests/ on sys.path
            "import test_no_such_module, pytest_asyncio, torch.testing",  # 11: none of tests/
        ]
    )
    assert imported_test_modules(source) == [
        "1: tests.test_configs",
        "2: tests.test_forking",
        "3: tests.test_dry_run",
        "4: tests.test_viz_tokens",
        "5: tests.test_e2e_trainer",
        "7: tests.test_launch_scripts",
        "10: test_configs",
    ]
    # from a module of tests.support: one dot is tests.support itself, two dots are tests
    assert imported_test_modules("from ..test_dry_run import x", "tests.support") == ["1: tests.test_dry_run"]
    assert imported_test_modules("from .e2e import x\nfrom .. import conftest", "tests.support") == []


def test_no_module_under_tests_imports_a_test_module():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        package = ".".join(["tests", *path.parent.relative_to(TESTS).parts])
        if imports := imported_test_modules(path.read_text(encoding="utf-8"), package):
            found[str(path.relative_to(TESTS.parent))] = imports
    assert found == {}, "share through tests/support/ instead"


def test_shared_helpers_live_in_the_support_package():
    assert (TESTS / "support" / "__init__.py").is_file()
    assert sorted(p.name for p in TESTS.glob("*_support.py")) == []
    assert sorted(p.name for p in (TESTS / "support").glob("test_*.py")) == []  # nothing is collected from there
