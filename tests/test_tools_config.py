"""The agentic preset's tool settings, checked before Ray starts: ``agent=calculator`` and the launcher's dry run
(``bash scripts/run.sh gtpo qwen2.5_7b agent=calculator``).

    .venv/bin/python -m pytest -q -n 0 tests/test_tools_config.py

Each broken setting (a missing or unparseable tool config, a tool class that does not import or is no tool, limits
out of range, an unknown parser) fails :func:`gtpo.tools.config.check_multi_turn` with one line naming the key; the
launcher's ``DRY_RUN=1`` then exits 2 with that line, before Ray starts.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gtpo.tools.config import check_multi_turn, check_tool_config
from tests.support.configs import compose
from tests.support.launch import dry_run_env

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "scripts" / "run.sh"
RUN = ["gtpo", "qwen2.5_7b", "agent=calculator"]
TOOL_CONFIG = REPO / "recipe" / "gtpo" / "tools" / "calculator.yaml"
KEY = "actor_rollout_ref.rollout.multi_turn"


@pytest.fixture(scope="module")
def preset():
    return compose(["method=gtpo", "model=qwen2.5_7b", "agent=calculator"])


def test_the_preset_turns_on_the_tool_loop_with_the_calculator(preset):
    multi_turn = preset.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable is True and multi_turn.format == "gtpo_hermes"
    assert multi_turn.max_assistant_turns == 8 and multi_turn.max_tool_response_length == 256
    assert preset.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
    assert (REPO / multi_turn.tool_config_path).resolve() == TOOL_CONFIG
    cwd = os.getcwd()
    os.chdir(REPO)  # the launchers run from the checkout; the relative path resolves there and on the cluster
    try:
        check_multi_turn(preset)
    finally:
        os.chdir(cwd)
    (entry,) = check_tool_config(str(TOOL_CONFIG))
    assert entry["class_name"] == "gtpo.tools.calculator.CalculatorTool"


def _with(preset, **multi_turn):
    cfg = OmegaConf.create(OmegaConf.to_container(preset, resolve=False))
    for key, value in multi_turn.items():
        OmegaConf.update(cfg, f"{KEY}.{key}", value, force_add=True)
    return cfg


def _tool_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return str(path)


GOOD_ENTRY = TOOL_CONFIG.read_text()


@pytest.mark.parametrize(
    "text, message",
    [
        (None, r"no such file"),
        ("tools: [unclosed", r"not a readable YAML tool config"),
        ("tools: []", r"needs a non-empty list under 'tools'"),
        (GOOD_ENTRY.replace("gtpo.tools.calculator.CalculatorTool", "gtpo.tools.abacus.AbacusTool"),
         r"tools\[0\]\.class_name=gtpo\.tools\.abacus\.AbacusTool: module gtpo\.tools\.abacus does not import"),
        (GOOD_ENTRY.replace("gtpo.tools.calculator.CalculatorTool", "gtpo.tools.calculator.Abacus"),
         r"tools\[0\]\.class_name=gtpo\.tools\.calculator\.Abacus: module gtpo\.tools\.calculator has no Abacus"),
        (GOOD_ENTRY.replace("gtpo.tools.calculator.CalculatorTool", "gtpo.tools.calculator.CalculatorLimits"),
         r"tools\[0\]\.class_name=gtpo\.tools\.calculator\.CalculatorLimits: not a verl BaseTool subclass"),
        (GOOD_ENTRY.replace("type: native", "type: mcp"), r"tools\[0\]\.config\.type='mcp': verl 0\.9\.1 loads only"),
        (GOOD_ENTRY.replace("max_digits: 100", "max_digits: 100000"),
         r"tools\[0\]\.config\.max_digits=100000: must be an integer in \[1, 1000\]"),
        (GOOD_ENTRY.replace("max_depth: 32", "max_depth: 0"), r"tools\[0\]\.config\.max_depth=0"),
        (GOOD_ENTRY.replace("max_depth: 32", "max_dept: 32"), r"tools\[0\]\.config: unknown key\(s\) max_dept;"),
        (GOOD_ENTRY.replace("      function:\n", "      fn:\n"), r"tools\[0\]\.tool_schema: not an OpenAI function"),
    ],
)  # fmt: skip
def test_a_broken_tool_config_is_named(preset, tmp_path, text, message):
    path = str(tmp_path / "missing.yaml") if text is None else _tool_config(tmp_path, text)
    with pytest.raises(ValueError, match=rf"^{KEY}\.tool_config_path={path}: {message}"):
        check_multi_turn(_with(preset, tool_config_path=path))


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"max_assistant_turns": 0}, r"max_assistant_turns=0: must be an integer in \[1, 64\]"),
        ({"max_parallel_calls": 100}, r"max_parallel_calls=100: must be an integer in \[1, 16\]"),
        ({"max_tool_response_length": -1}, r"max_tool_response_length=-1"),
        ({"max_user_turns": "many"}, r"max_user_turns='many'"),
        ({"tool_response_truncate_side": "top"}, r"tool_response_truncate_side='top'"),
        ({"format": "hermes2"}, r"format='hermes2': not a registered tool parser"),
        ({"tool_config_path": None}, r"enable=true with neither .*tool_config_path nor .*function_tool_path"),
    ],
)
def test_limits_and_the_parser_are_named(preset, setting, message):
    with pytest.raises(ValueError, match=rf"^{KEY}\.{message}"):
        check_multi_turn(_with(preset, **{"tool_config_path": str(TOOL_CONFIG), **setting}))


def test_multi_turn_off_reads_nothing(preset):
    check_multi_turn(_with(preset, enable=False, tool_config_path="/nowhere/tools.yaml", format="nope"))


def test_the_launchers_dry_run_validates_the_tool_config(tmp_path):
    """One dry run that passes and one with the limits out of range: one line naming the key, exit 2, no Ray."""
    broken = _tool_config(tmp_path, GOOD_ENTRY.replace("max_digits: 100", "max_digits: 0"))
    env = {**dry_run_env(tmp_path), "MODEL_PATH": str(tmp_path / "models" / "Qwen2.5-7B-Instruct")}
    runs = [
        subprocess.Popen(
            ["bash", str(LAUNCHER), *RUN, *extra],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for extra in ([], [f"{KEY}.tool_config_path={broken}"])
    ]
    (good_out, good_err), (bad_out, bad_err) = (run.communicate(timeout=600) for run in runs)
    assert runs[0].returncode == 0, good_err[-3000:]
    assert "[dry run] OK: run gtpo-qwen2.5-7b-agent_calculator" in good_out and "Ray was not started" in good_out
    assert runs[1].returncode == 2, bad_err[-3000:]
    lines = [line for line in bad_err.splitlines() if line.startswith("gtpo: ")]
    assert lines == [
        f"gtpo: invalid configuration: {KEY}.tool_config_path={broken}: tools[0].config.max_digits=0: must be an "
        "integer in [1, 1000]"
    ]
    assert "[dry run] OK" not in bad_out and "Started a local Ray instance" not in bad_out + bad_err


def test_a_parser_its_tool_module_registers_passes(tmp_path):
    """The CPU tool task's parser is registered when its tool class is imported (as verl's agent-loop workers import
    it from the tool config): the check imports the tools first, then looks the parser up."""
    from gtpo.cpu.tool_task import build_tool_task_assets, tool_task_overrides

    cfg = compose(["method=gtpo", "backend=cpu_tiny", *tool_task_overrides(build_tool_task_assets(tmp_path))])
    assert cfg.actor_rollout_ref.rollout.multi_turn.format == "gtpo_cpu_lookup"
    check_multi_turn(cfg)
