"""The calculator tool task: chained integer arithmetic solved one operation per tool call, with the
tool's schema, its safe evaluator, and the gold tool-using conversation for SFT.

The tool is a stepping calculator: given an expression it carries out one operation (the first product,
else the leftmost sum or difference) and returns the rest ('7*3-5' -> '21-5' -> '16'), so a problem
takes one call per operation. Each call's argument is a span the model copies from the last message,
which a tiny model learns far sooner than assembling operands. No `eval`: the expression is matched by
a pattern and reduced by operator.
"""

from __future__ import annotations

import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

TOOL_NAME = "calculator"
OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CONVERSATION_KEY = "conversation"  # metadata: the gold messages that follow the prompt (SFT target)
MAX_DIGITS = 9
MAX_OPERATIONS = 8
_NUMBER = rf"-?\d{{1,{MAX_DIGITS}}}"
_EXPRESSION = re.compile(rf"\s*{_NUMBER}(?:\s*[-+*]\s*{_NUMBER}){{0,{MAX_OPERATIONS}}}\s*")
_FIRST = re.compile(rf"\s*({_NUMBER})")
_TERM = re.compile(rf"\s*([-+*])\s*({_NUMBER})")

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Does one step of an expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


class ToolError(ValueError):
    """A tool call the calculator cannot run; the message names the argument and its value."""


def parse_expression(expression: Any) -> tuple[list[int], list[str]]:
    """(numbers, operators) of 'a op b op c ...': integers of up to 9 digits, op one of + - *, at most
    8 operations, no brackets."""
    if not isinstance(expression, str) or _EXPRESSION.fullmatch(expression) is None:
        raise ToolError(f"{TOOL_NAME}: expression = {expression!r:.80}; expected integers joined by + - * "
                        f"(at most {MAX_OPERATIONS} operations, no brackets), e.g. '7*3-5'")
    first = _FIRST.match(expression)
    terms = _TERM.findall(expression, first.end())
    return [int(first.group(1))] + [int(n) for _, n in terms], [op for op, _ in terms]


def step(expression: Any) -> str:
    """One operation of `expression` carried out: the first product, else the leftmost sum or difference
    ('7*3-5' -> '21-5', '2+3*4' -> '2+12', '21-5' -> '16'); a lone number comes back as it is."""
    numbers, ops = parse_expression(expression)
    if not ops:
        return str(numbers[0])
    i = ops.index("*") if "*" in ops else 0
    numbers[i : i + 2] = [OPERATIONS[ops.pop(i)](numbers[i], numbers[i + 1])]
    return str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(ops, numbers[1:]))


def calculate(arguments: Any) -> str:
    """The tool's reply to one call's arguments {"expression": "..."} (an object or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ToolError(f"{TOOL_NAME}: arguments {arguments!r:.80} are not JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"{TOOL_NAME}: arguments must be an object, got {type(arguments).__name__}")
    unknown = sorted(set(arguments) - {"expression"})
    if unknown:
        raise ToolError(f"{TOOL_NAME}: unknown arguments {unknown}; expected expression")
    return step(arguments.get("expression"))


def tool_call_message(index: int, expression: str) -> dict[str, Any]:
    """An assistant message with one calculator call, in the OpenAI shape (arguments as JSON text)."""
    arguments = json.dumps({"expression": expression})
    call = {"id": f"call_{index}", "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def gold_conversation(expression: str) -> list[dict[str, Any]]:
    """Call the calculator on what is left until one number remains, then state it."""
    conversation: list[dict[str, Any]] = []
    while parse_expression(expression)[1]:
        index = len(conversation) // 2 + 1
        reply = step(expression)
        conversation += [tool_call_message(index, expression),
                         {"role": "tool", "tool_call_id": f"call_{index}", "content": reply}]
        expression = reply
    return conversation + [{"role": "assistant", "content": expression}]


def calculator_problem(
    rng: random.Random, min_steps: int = 2, max_steps: int = 2, max_operand: int = 9
) -> tuple[str, str, dict[str, Any]]:
    """(prompt text, answer, metadata) for one chained expression such as '3*7-5=' -> '16'.

    A product never follows a sum or difference, so the operations apply left to right as written,
    without brackets, and prompts have a fixed layout. The gold conversation makes one calculator call
    per operation, then states the final value.
    """
    expression, additive = str(rng.randint(2, max_operand)), False
    for _ in range(rng.randint(min_steps, max_steps)):
        op = rng.choice("+-" if additive else "+-*")
        expression += f"{op}{rng.randint(2, max_operand)}"
        additive = op != "*"
    conversation = gold_conversation(expression)
    metadata = {"task": "calculator", "expression": expression, "tools": [CALCULATOR_TOOL],
                CONVERSATION_KEY: conversation}
    return f"{expression}=", conversation[-1]["content"], metadata


def call_expression(message: dict[str, Any]) -> str:
    """The expression of an assistant message's (first) calculator call."""
    return json.loads(message["tool_calls"][0]["function"]["arguments"])["expression"]
