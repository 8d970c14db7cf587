"""The calculator tool and the hermes parser of the agentic preset: arithmetic only, every bad call answered.

    .venv/bin/python -m pytest -q -n 0 tests/test_tools_calculator.py

Bad calls go through verl's own ``ToolAgentLoop._call_tool`` (unknown tool, malformed JSON) with the recipe's parser
(``gtpo_hermes``) and tool; each gives the model an error text. That no bad expression hangs is decided without a
clock: the exact integer power is the only operation whose cost grows with its operands' values, and the test spies
on it to show that the refused powers are never attempted.
"""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.schemas import ToolResponse

from gtpo.tools import calculator
from gtpo.tools.calculator import CalculatorError, CalculatorLimits, CalculatorTool, evaluate, format_value
from gtpo.tools.hermes import NOT_JSON, PARSER_NAME, parse_call

GOOD = [
    ("(3 + 4) * 12 / 5", "16.8"),
    ("2 ** 10 - 1", "1023"),
    ("-7 // 2", "-4"),
    ("17 % 5", "2"),
    ("0.1 + 0.2", "0.3"),
    ("10 ** -3", "0.001"),
    ("((((1 + 2))))", "3"),
    ("2 ** 332", str(2**332)),  # 100 digits: the largest power of two within the default limit
    ("1_000 * 3", "3000"),
]
BAD = [
    ("9**9**9", "the power has more than 100 digits"),
    ("10**10**10", "the power has more than 100 digits"),
    ("2 ** 333", "more than 100 digits"),
    ("__import__('os')", "function calls are not allowed"),
    ("__import__('os').system('ls')", "function calls are not allowed"),
    ("(2).__class__", "attribute access is not allowed"),
    ("(1).real", "attribute access is not allowed"),
    ("x + 1", "names are not allowed"),
    ("[1, 2][0]", "subscripts are not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("lambda: 1", "Lambda is not arithmetic"),
    ("[i for i in range(9**9)]", "ListComp is not arithmetic"),
    ("1 ^ 2", "use ** for powers"),
    ("1 << 4000", "LShift is not allowed"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "0 cannot be raised to a negative power"),
    ("(-8) ** 0.5", "not a real number"),
    ("1e308 * 10", "not a finite number"),
    ("2.0 ** 100000", "** failed"),
    ("", "the expression is empty"),
    ("1 +", "not an arithmetic expression"),
    ("1\x00", "not an arithmetic expression"),
    ("-" * 40 + "1", "nested deeper than 32 levels"),
    ("(" * 200 + "1" + ")" * 200, "longer than 256 characters"),
    (42, "must be a string"),
]


@pytest.mark.parametrize("expression, shown", GOOD)
def test_arithmetic(expression, shown):
    assert format_value(evaluate(expression)) == shown


@pytest.mark.parametrize("expression, reason", BAD)
def test_everything_else_is_refused_with_its_reason(expression, reason):
    with pytest.raises(CalculatorError, match=reason.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expression)


def test_refused_powers_are_never_attempted(monkeypatch):
    """The guard decides from the operands' sizes: the integer power it refuses is never computed."""
    attempted = []

    def spy(base, exponent):
        attempted.append((base, exponent))
        assert not (isinstance(base, int) and isinstance(exponent, int) and exponent > 1000), "a huge power ran"
        return math.pow(base, exponent) if isinstance(base, float) else base**exponent

    monkeypatch.setitem(calculator._BINARY, calculator.ast.Pow, spy)
    for expression in ("9**9**9", "10**10**10", "7 ** 999999999999"):
        with pytest.raises(CalculatorError, match="the power has more than"):
            evaluate(expression)
    assert attempted == [(9, 9), (10, 10)]  # only the inner powers, 9**9 and 10**10


def test_without_the_guard_the_spy_would_see_the_huge_power(monkeypatch):
    """The planted fault: with the size check removed, ``10**10**10`` reaches the power (the spy stops it)."""

    def spy(base, exponent):
        if exponent > 1000:
            pytest.fail(f"attempted {base}**{exponent}")
        return base**exponent

    monkeypatch.setattr(calculator, "_check_power", lambda base, exponent, limits: None)
    monkeypatch.setitem(calculator._BINARY, calculator.ast.Pow, spy)
    with pytest.raises(pytest.fail.Exception, match=r"attempted 10\*\*10000000000"):
        evaluate("10**10**10")


def test_deep_nesting_is_refused_by_the_parser_or_the_depth_limit():
    wide = CalculatorLimits(max_expression_chars=10_000, max_depth=100)
    for expression in ("(" * 1000 + "1" + ")" * 1000, "-" * 5000 + "1", "+".join(["(1"] * 500) + ")" * 500):
        with pytest.raises(CalculatorError, match="not an arithmetic expression|nested deeper"):
            evaluate(expression, wide)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"max_digits": 0}, r"config.max_digits=0: must be an integer in \[1, 1000\]"),
        ({"max_depth": 101}, r"config.max_depth=101: must be an integer"),
        ({"max_expression_chars": True}, r"config.max_expression_chars=True"),
        ({"max_digit": 10}, r"config: unknown key\(s\) max_digit;"),
    ],
)
def test_limits_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        CalculatorLimits.from_config({"type": "native", **config})


def test_limits_apply():
    small = CalculatorLimits(max_digits=3, max_expression_chars=8)
    assert evaluate("999 + 0", small) == 999
    with pytest.raises(CalculatorError, match="more than 3 digits"):
        evaluate("999 + 1", small)
    with pytest.raises(CalculatorError, match="longer than 8"):
        evaluate("1 + 2 + 3 + 4", small)


# ---------------------------------------------------------------------------------------------------------------------
# through verl's agent loop


class _Tokenizer:
    """Decodes byte ids (enough for the hermes parser, which decodes a turn and reads its text)."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8")


def _tool_reply(call: FunctionCall) -> str:
    """What verl's ``ToolAgentLoop._call_tool`` answers ``call`` with, the calculator its one tool."""
    tool = CalculatorTool({"type": "native"})
    loop = SimpleNamespace(tools={tool.name: tool}, max_tool_response_length=256, tool_response_truncate_side="right")
    agent = SimpleNamespace(_active_tools=loop.tools)
    response, reward, _ = asyncio.run(ToolAgentLoop._call_tool(loop, call, {}, agent))
    assert isinstance(response, ToolResponse) and reward == 0.0
    return response.text


def _calls(text: str) -> list[FunctionCall]:
    parser = ToolParser.get_tool_parser(PARSER_NAME, _Tokenizer())
    content, calls = asyncio.run(parser.extract_tool_calls(list(text.encode("utf-8"))))
    assert "<tool_call>" not in content
    return calls


def _call(body: str) -> str:
    return f"I will compute it.\n<tool_call>\n{body}\n</tool_call>"


def test_a_good_call_gets_the_number():
    calls = _calls(_call(json.dumps({"name": "calculator", "arguments": {"expression": "(3 + 4) * 12 / 5"}})))
    assert [c.name for c in calls] == ["calculator"] and _tool_reply(calls[0]) == "16.8"


@pytest.mark.parametrize(
    "body, reply",
    [
        # malformed JSON, a name still readable: verl's invalid-arguments error
        ('{"name": "calculator", "arguments": {"expression": "1+1"', "Invalid JSON in arguments for 'calculator'"),
        # malformed beyond a name: verl's unknown-function error, whose name says why
        ("calculator(1+1)", f"Unknown function '{NOT_JSON}'. Available tools: ['calculator']"),
        # an unknown tool
        ('{"name": "python", "arguments": {"code": "print(1)"}}', "Unknown function 'python'"),
        # arguments of the wrong shape
        ('{"name": "calculator", "arguments": "1+1"}', 'error: the arguments must be {"expression"'),
        ('{"name": "calculator", "arguments": {"expr": "1+1"}}', "error: the arguments must be"),
        ('{"name": "calculator"}', "error: the arguments must be"),
        # expressions the calculator refuses
        ('{"name": "calculator", "arguments": {"expression": "9**9**9"}}', "error: the power has more than"),
        ('{"name": "calculator", "arguments": {"expression": "10**10**10"}}', "error: the power has more than"),
        ('{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}', "error: function calls"),
        ('{"name": "calculator", "arguments": {"expression": "(1).__class__"}}', "error: attribute access"),
        ('{"name": "calculator", "arguments": {"expression": "' + "(" * 300 + "1" + ")" * 300 + '"}}', "error:"),
        ('{"name": "calculator", "arguments": {"expression": 7}}', "error: the expression must be a string"),
    ],
)
def test_a_bad_call_gets_a_tool_error(body, reply):
    calls = _calls(_call(body))
    assert len(calls) == 1
    assert _tool_reply(calls[0]).startswith(reply) or reply in _tool_reply(calls[0])


def test_verls_own_hermes_parser_drops_a_malformed_call():
    """Why the recipe has its parser: verl's ``hermes`` ends the episode on such a call instead of answering it."""
    parser = ToolParser.get_tool_parser("hermes", _Tokenizer())
    text = _call('{"name": "calculator", "arguments": {"expression": "1+1"')
    assert asyncio.run(parser.extract_tool_calls(list(text.encode())))[1] == []
    assert len(_calls(text)) == 1


def test_parse_call_keeps_well_formed_calls_as_verl_does():
    call = parse_call('{"name": "calculator", "arguments": {"expression": "2*3"}}')
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "2*3"}
    deep = parse_call("[" * 100_000)  # the JSON parser's recursion is caught
    assert deep.name == NOT_JSON
