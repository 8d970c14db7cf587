"""The CPU tool task's tool and tool-call parser, as verl's agent-loop workers load them (:mod:`gtpo.cpu.tool_task`).

verl imports this module in each agent-loop worker when it loads the tool config's ``LookupTool``
(``multi_turn.tool_config_path``), before it builds a ``ToolAgentLoop``; the import registers the parser under
``gtpo_cpu_lookup`` (``multi_turn.format``) through verl's own ``ToolParser.register``.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from gtpo.cpu.tool_task import CALL_WORD, PARSER_NAME, TOOL_NAME

__all__ = ["LookupCallParser", "LookupTool"]


@ToolParser.register(PARSER_NAME)
class LookupCallParser(ToolParser):
    """A turn that says ``lookup`` calls the tool, without arguments; generation stops at that word."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.call_id = tokenizer.convert_tokens_to_ids(CALL_WORD)

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.call_id]

    async def extract_tool_calls(self, responses_ids, tools=None) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        if self.call_id not in list(responses_ids):
            return text, []
        return text, [FunctionCall(name=TOOL_NAME, arguments="{}")]


class LookupTool(BaseTool):
    """Replies with the digit stored under the key the prompt named, one per row (its ``create_kwargs``)."""

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        self._values: dict[str, str] = {}

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id, response = await super().create(instance_id)
        self._values[instance_id] = str((kwargs.get("create_kwargs") or {}).get("value", "?"))
        return instance_id, response

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=self._values.get(instance_id, "?")), 0.0, {}

    async def release(self, instance_id: str, **kwargs) -> None:
        self._values.pop(instance_id, None)
