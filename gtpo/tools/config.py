"""The multi-turn tool settings of a composed trainer config, checked before Ray starts (the launchers' dry run).

verl reads ``actor_rollout_ref.rollout.multi_turn`` only in its agent-loop workers, minutes into a run: a missing or
broken tool config, a class that does not import or limits out of range would fail there, or not at all (a tool
whose calls never parse trains a model that never calls it). :func:`check_multi_turn` fails at once with one line
naming the key instead. It does what verl's loader does short of building the tools: reads the YAML, imports each
``class_name`` and checks it is a verl ``BaseTool``, validates the tool schema as verl does, and for the recipe's
calculator its limits (:class:`gtpo.tools.calculator.CalculatorLimits`).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["check_multi_turn", "check_tool_config"]

PREFIX = "actor_rollout_ref.rollout.multi_turn"
# Limits of the multi-turn block: (key, smallest, largest); None in the config means verl's own default.
LIMITS = (
    ("max_assistant_turns", 1, 64),
    ("max_user_turns", 1, 64),
    ("max_parallel_calls", 1, 16),
    ("max_tool_response_length", 1, 65_536),
)
TRUNCATE_SIDES = ("left", "middle", "right")


def check_multi_turn(config: DictConfig) -> None:
    """Refuse, naming the key, a multi-turn block that would fail or do nothing in verl's agent-loop workers."""
    multi_turn = OmegaConf.select(config, PREFIX, default=None)
    if multi_turn is None or not multi_turn.get("enable", False):
        return
    for key, lo, hi in LIMITS:
        value = multi_turn.get(key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{PREFIX}.{key}={value!r}: must be an integer in [{lo}, {hi}] (or null)")
    side = multi_turn.get("tool_response_truncate_side", "middle")
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"{PREFIX}.tool_response_truncate_side={side!r}: must be one of {list(TRUNCATE_SIDES)}")
    tool_config_path = multi_turn.get("tool_config_path", None)
    function_tool_path = multi_turn.get("function_tool_path", None)
    if not tool_config_path and not function_tool_path:
        raise ValueError(
            f"{PREFIX}.enable=true with neither {PREFIX}.tool_config_path nor {PREFIX}.function_tool_path: the agent "
            "loop would have no tool to call"
        )
    if tool_config_path:
        check_tool_config(str(tool_config_path), f"{PREFIX}.tool_config_path")
    if function_tool_path and not os.path.isfile(str(function_tool_path)):
        raise ValueError(f"{PREFIX}.function_tool_path={function_tool_path}: no such file")
    # after the tool classes are imported: a tool's module may register its parser, as verl's workers import it
    _check_parser(str(multi_turn.get("format", "hermes")))


def _check_parser(name: str) -> None:
    """verl's public lookup builds the parser; without the run's tokenizer a registered parser may fail to build in
    another way, which is no error of the name."""
    from verl.experimental.agent_loop.tool_parser import ToolParser

    import gtpo.tools.hermes  # noqa: F401 - the recipe's parser, as gtpo.verl_plugin.register registers it

    try:
        ToolParser.get_tool_parser(name, None)
    except ValueError as err:
        if str(err).startswith("Unknown tool parser"):
            raise ValueError(
                f"{PREFIX}.format={name!r}: not a registered tool parser (e.g. verl's hermes, the recipe's gtpo_hermes)"
            ) from None
    except Exception:  # noqa: BLE001 - registered; it needs the real tokenizer to build
        pass


def check_tool_config(path: str, key: str = f"{PREFIX}.tool_config_path") -> list[dict[str, Any]]:
    """Read a verl tool config (``tools: [{class_name, config: {type: native, ...}, tool_schema}]``) as verl's
    ``initialize_tools_from_config`` would, without building the tools; returns its entries. Raises ``ValueError``
    naming ``key`` (and the entry) for a missing or unparseable file, a class that does not import or is no
    ``BaseTool``, a ``type`` other than ``native``, a schema verl rejects, or calculator limits out of range."""
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    if not os.path.isfile(path):
        raise ValueError(f"{key}={path}: no such file")
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # OmegaConf wraps YAML errors in several types
        raise ValueError(f"{key}={path}: not a readable YAML tool config ({type(err).__name__}: {err})") from None
    tools = loaded.get("tools") if isinstance(loaded, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{key}={path}: needs a non-empty list under 'tools'")
    names = set()
    for i, entry in enumerate(tools):
        where = f"{key}={path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where}.class_name: missing (a dotted path, e.g. gtpo.tools.calculator.CalculatorTool)")
        cls = _import_class(entry["class_name"], f"{where}.class_name")
        if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
            raise ValueError(f"{where}.class_name={entry['class_name']}: not a verl BaseTool subclass")
        tool_config = entry.get("config") or {}
        if tool_config.get("type") != "native":
            raise ValueError(f"{where}.config.type={tool_config.get('type')!r}: verl 0.9.1 loads only 'native' tools")
        schema = entry.get("tool_schema")
        if schema is not None:
            try:
                name = OpenAIFunctionToolSchema.model_validate(schema).function.name
            except Exception as err:
                raise ValueError(f"{where}.tool_schema: not an OpenAI function schema ({err})") from None
            if name in names:
                raise ValueError(f"{where}.tool_schema.function.name={name!r}: a second tool of that name")
            names.add(name)
        from gtpo.tools.calculator import CalculatorLimits, CalculatorTool

        if issubclass(cls, CalculatorTool):
            CalculatorLimits.from_config(tool_config, prefix=f"{where}.config")
    return tools


def _import_class(dotted: str, where: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}={dotted}: not a dotted path module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{where}={dotted}: module {module_name} does not import ({err})") from None
    if not hasattr(module, attr):
        raise ValueError(f"{where}={dotted}: module {module_name} has no {attr}")
    return getattr(module, attr)
