"""Each module of the CPU backend imports on its own in a fresh interpreter with the backend's environment, as a Ray
worker does when it unpickles an actor class (the module of the class is imported first, then verl imports
``VERL_USE_EXTERNAL_MODULES``, which import the backend's modules back).

Run: ``.venv/bin/pytest -q tests/test_cpu_module_imports.py``  (a few seconds per module)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["gtpo.cpu.hf_server", "gtpo.cpu.hf_rollout", "gtpo.cpu.hf_sampler"])
def test_module_imports_first_in_a_fresh_worker(module):
    from gtpo.cpu import env

    code = f"import {module}, verl.workers.rollout.base as b; assert ('hf', 'async') in b._ROLLOUT_REGISTRY"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env(base={"PATH": "/usr/bin:/bin"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
