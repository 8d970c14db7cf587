"""Hermes tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen2.5's format), with every call
the model writes answered, under ``multi_turn.format=gtpo_hermes``.

verl's ``hermes`` parser drops a call whose JSON does not parse: the turn then holds no call, the episode ends, and
the model never learns what was wrong. This parser keeps such a call, so that verl's ``ToolAgentLoop`` answers it with
a tool error as it answers every other bad call (``_call_tool``): a call whose name can still be read gets verl's
``Invalid JSON in arguments for '<name>': ...``; one without a readable name gets ``Unknown function '<tool_call> is
not JSON'. Available tools: [...]``. Well-formed calls parse as verl's parser parses them; a call without
``arguments`` calls the tool with none. Registered into verl's ``ToolParser`` registry by
:mod:`gtpo.verl_plugin.register` in every process.
"""

from __future__ import annotations

import json

import regex
from verl.experimental.agent_loop.tool_parser import FunctionCall, HermesToolParser, ToolParser
from verl.utils.ray_utils import get_event_loop

__all__ = ["NOT_JSON", "HermesAnsweringParser", "parse_call"]

PARSER_NAME = "gtpo_hermes"
# The name a call without a readable name takes: verl's reply to an unknown name then reads as the reason.
NOT_JSON = "<tool_call> is not JSON"
_NAME = regex.compile(r'"name"\s*:\s*"([^"\\]{1,64})"')


def parse_call(body: str) -> FunctionCall:
    """One ``<tool_call>`` body as a call verl can answer (arguments as a JSON string, or the raw body when the JSON
    does not parse, which verl then answers with an error)."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        call = None
    if isinstance(call, dict) and isinstance(call.get("name"), str):
        return FunctionCall(name=call["name"], arguments=json.dumps(call.get("arguments", {}), ensure_ascii=False))
    found = _NAME.search(body)
    return FunctionCall(name=found.group(1) if found else NOT_JSON, arguments=body.strip())


@ToolParser.register(PARSER_NAME)
class HermesAnsweringParser(HermesToolParser):
    """verl's hermes parser, except that a call it cannot parse is kept (:func:`parse_call`)."""

    async def extract_tool_calls(self, responses_ids, tools=None) -> tuple[str, list[FunctionCall]]:
        text = await get_event_loop().run_in_executor(None, self.tokenizer.decode, responses_ids)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        calls = [parse_call(body) for body in self.tool_call_regex.findall(text)]
        return self.tool_call_regex.sub("", text), calls
