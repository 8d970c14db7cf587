"""A calculator tool that evaluates arithmetic only, for agentic math runs on verl's ``ToolAgentLoop``.

The model writes an expression (``{"name": "calculator", "arguments": {"expression": "(3 + 4) * 12 / 5"}}``); the tool
parses it with Python's ``ast`` and walks a whitelist: numbers (int, float), ``+ - * / // % **``, unary ``+ -`` and
parentheses. Nothing else is evaluated: no name, call, attribute, subscript, string, comprehension or lambda, and
never ``eval`` or ``exec``. Every cost is bounded before it is paid: the expression's length and nesting depth, the
digits of every number it makes (an integer power or product is refused from its operands' sizes before it is
computed, so ``9**9**9`` or ``10**10**10`` are refused, not attempted), and floats must stay finite. A bad call
gives the model an error text as the tool's reply; the tool never raises into the agent loop and never hangs.

``CalculatorTool`` is a verl ``BaseTool`` (``multi_turn.tool_config_path``: ``recipe/gtpo/tools/calculator.yaml``);
its limits come from the tool config's ``config`` block (:class:`CalculatorLimits`, validated with the key named).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, fields
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CalculatorError", "CalculatorLimits", "CalculatorTool", "evaluate", "format_value"]

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the number.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (3 + 4) * 12 / 5"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is what the model reads."""


@dataclass(frozen=True)
class CalculatorLimits:
    """The calculator's bounds (the tool config's ``config`` block; every field optional).

    Attributes:
        max_expression_chars: longest expression read (1 .. 10,000).
        max_depth: deepest nesting of operations (1 .. 100; Python's own parser stops near 200).
        max_digits: most decimal digits of any integer operand or result (1 .. 1,000); a power or product whose
            operands' sizes exceed it is refused before it is computed.
    """

    max_expression_chars: int = 256
    max_depth: int = 32
    max_digits: int = 100

    def __post_init__(self) -> None:
        for name, hi in (("max_expression_chars", 10_000), ("max_depth", 100), ("max_digits", 1_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"{name}={value!r}: must be an integer in [1, {hi}]")

    @classmethod
    def from_config(cls, config: dict | None, prefix: str = "config") -> CalculatorLimits:
        """The limits of a tool config's ``config`` block (``type`` and unknown keys refused, the key named)."""
        values = dict(config or {})
        values.pop("type", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{prefix}: unknown key(s) {', '.join(unknown)}; valid: {sorted(known)}")
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"{prefix}.{err}") from None

    @property
    def bound(self) -> int:
        """The smallest integer with more than ``max_digits`` digits."""
        return 10**self.max_digits


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
_REFUSED = {
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
}
_HINT = "use numbers, + - * / // % ** and parentheses"


def evaluate(expression: Any, limits: CalculatorLimits | None = None) -> int | float:
    """The value of an arithmetic expression; :class:`CalculatorError` (with the reason) for anything else."""
    limits = limits or CalculatorLimits()
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > limits.max_expression_chars:
        raise CalculatorError(f"the expression is longer than {limits.max_expression_chars} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"not an arithmetic expression ({_HINT})") from None
    return _value(tree.body, limits, 1)


def _value(node: ast.AST, limits: CalculatorLimits, depth: int) -> int | float:
    if depth > limits.max_depth:
        raise CalculatorError(f"the expression is nested deeper than {limits.max_depth} levels")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {type(value).__name__} ({_HINT})")
        return _checked(value, limits)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _value(node.operand, limits, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _value(node.left, limits, depth + 1)
        right = _value(node.right, limits, depth + 1)
        return _checked(_apply(type(node.op), left, right, limits), limits)
    if isinstance(node, ast.BinOp):
        hint = "use ** for powers" if isinstance(node.op, ast.BitXor) else _HINT
        raise CalculatorError(f"operator {type(node.op).__name__} is not allowed ({hint})")
    for kind, reason in _REFUSED.items():
        if isinstance(node, kind):
            raise CalculatorError(f"{reason} ({_HINT})")
    raise CalculatorError(f"{type(node).__name__} is not arithmetic ({_HINT})")


def _apply(op: type, left: int | float, right: int | float, limits: CalculatorLimits) -> int | float:
    """One operation, refused from its operands' sizes when its result would be too large to compute."""
    symbol = _SYMBOL[op]
    if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
        raise CalculatorError(f"division by zero in {symbol}")
    if op is ast.Pow:
        _check_power(left, right, limits)
    try:
        result = _BINARY[op](left, right)
    except (OverflowError, ZeroDivisionError) as err:
        raise CalculatorError(f"{symbol} failed: {err}") from None
    if isinstance(result, complex):
        raise CalculatorError("the result is not a real number (a negative number to a fractional power)")
    return result


def _check_power(base: int | float, exponent: int | float, limits: CalculatorLimits) -> None:
    """An integer power is exact and costs its result's size: refuse it from log2|base| * exponent first. Every other
    power is a float operation of fixed cost (overflow raises, checked by the caller)."""
    if base == 0 and exponent < 0:
        raise CalculatorError("0 cannot be raised to a negative power")
    integers = isinstance(base, int) and isinstance(exponent, int)
    if integers and exponent > 0 and abs(base) > 1 and exponent * math.log10(abs(base)) > limits.max_digits:
        raise CalculatorError(f"the power has more than {limits.max_digits} digits")


def _checked(value: int | float, limits: CalculatorLimits) -> int | float:
    if isinstance(value, int) and abs(value) >= limits.bound:
        raise CalculatorError(f"a number has more than {limits.max_digits} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_value(value: int | float) -> str:
    """An integer as it is; a float with 12 significant digits (``0.1 + 0.2`` reads ``0.3``)."""
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class CalculatorTool(BaseTool):
    """verl ``BaseTool``: ``calculator(expression)`` -> the number, or ``error: <reason>`` for a call it refuses."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        self.limits = CalculatorLimits.from_config(config)
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMA))

    async def execute(self, instance_id: str, parameters: Any, **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=self.reply(parameters)), 0.0, {}

    def reply(self, parameters: Any) -> str:
        """The tool's reply to the call's arguments (a dict holding ``expression`` and nothing else)."""
        if not isinstance(parameters, dict) or set(parameters) != {"expression"}:
            keys = sorted(parameters) if isinstance(parameters, dict) else type(parameters).__name__
            return f'error: the arguments must be {{"expression": "<arithmetic>"}}, got {keys}'
        try:
            return format_value(evaluate(parameters["expression"], self.limits))
        except CalculatorError as err:
            return f"error: {err}"
