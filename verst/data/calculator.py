"""The calculator tool task: chained integer arithmetic solved one binary operation per tool call,
with the tool's schema, its safe evaluator, and the gold tool-using conversation for SFT.

The tool computes one operation ('7*3'), so every problem needs several calls and a model that cannot
multiply by itself must use it. No `eval`: the expression is matched by a pattern, dispatched by operator.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import random
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verst.data.tasks import Problem

TOOL_NAME = "calculator"
OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CONVERSATION_KEY = "conversation"  # metadata: the gold messages that follow the prompt (SFT target)
MAX_DIGITS = 9
_OPERATION = re.compile(rf"\s*(-?\d{{1,{MAX_DIGITS}}})\s*([-+*])\s*(-?\d{{1,{MAX_DIGITS}}})\s*")

# One string argument rather than (a, op, b): the call copies a span of the prompt ('7*3' from '7*3-5='),
# which a tiny model learns several times faster than three separate JSON fields.
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "a op b",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


class ToolError(ValueError):
    """A tool call the calculator cannot run; the message names the argument and its value."""


def parse_operation(expression: Any) -> tuple[int, str, int]:
    """(a, op, b) of one operation 'a op b' (integers of up to 9 digits, op one of + - *)."""
    match = _OPERATION.fullmatch(expression) if isinstance(expression, str) else None
    if match is None:
        raise ToolError(f"{TOOL_NAME}: expression = {expression!r:.80}; expected one operation 'a op b' of "
                        f"integers with op one of {sorted(OPERATIONS)}, e.g. '7*3'")
    return int(match.group(1)), match.group(2), int(match.group(3))


def calculate(arguments: Any) -> int:
    """The value of one call's arguments {"expression": "a op b"} (an object or its JSON text)."""
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
    a, op, b = parse_operation(arguments.get("expression"))
    return OPERATIONS[op](a, b)


def tool_call_message(step: int, a: int, op: str, b: int) -> dict[str, Any]:
    """An assistant message with one calculator call, in the OpenAI shape (arguments as JSON text)."""
    arguments = json.dumps({"expression": f"{a}{op}{b}"})
    call = {"id": f"call_{step}", "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def call_operation(message: dict[str, Any]) -> tuple[int, str, int]:
    """(a, op, b) of a gold assistant message's calculator call."""
    return parse_operation(json.loads(message["tool_calls"][0]["function"]["arguments"])["expression"])


def calculator_problem(
    rng: random.Random, min_steps: int = 2, max_steps: int = 2, max_operand: int = 9, brackets: bool = False
) -> tuple[str, str, dict[str, Any]]:
    """(prompt text, answer, metadata) for one chained expression such as '3*7-5=' -> '16'.

    Operations apply left to right. Without `brackets`, a product never follows a sum or difference,
    so the written precedence agrees with no brackets at all (and prompts have a fixed layout, which a
    tiny model copies from more easily); with them, '(3+7)*5=' style prompts appear too. The gold
    conversation makes one calculator call per operation, then states the final value.
    """
    value = rng.randint(2, max_operand)
    expression, additive = str(value), False
    conversation: list[dict[str, Any]] = []
    for step in range(1, rng.randint(min_steps, max_steps) + 1):
        op, n = rng.choice("+-" if additive and not brackets else "+-*"), rng.randint(2, max_operand)
        expression = f"({expression})*{n}" if op == "*" and additive else f"{expression}{op}{n}"
        additive = op != "*"
        result = OPERATIONS[op](value, n)
        conversation.append(tool_call_message(step, value, op, n))
        conversation.append({"role": "tool", "tool_call_id": f"call_{step}", "content": str(result)})
        value = result
    conversation.append({"role": "assistant", "content": str(value)})
    metadata = {"task": "calculator", "expression": expression, "tools": [CALCULATOR_TOOL],
                CONVERSATION_KEY: conversation}
    return f"{expression}=", str(value), metadata


def mental_last_step(problems: list[Problem], rate: float, ops: str = "+", seed: int = 0) -> list[Problem]:
    """Demonstrations from a teacher who does an easy last step in their head: in `rate` of the problems
    whose last operation is one of `ops`, the conversation answers right after the previous tool result,
    without the last calculator call. Every answer stays correct.

    A student that cannot add in its head, imitating this teacher, skips the call it needs there once
    `rate` > 0.5; an outcome reward shows that calling the tool pays. Altered rows record
    `metadata['teacher'] = 'mental last step'`; prompts and their order are unchanged.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"mental_last_step: rate must be in [0, 1], got {rate}")
    if not ops or set(ops) - set(OPERATIONS):
        raise ValueError(f"mental_last_step: ops = {ops!r} must be a non-empty string of {sorted(OPERATIONS)}")
    rng = random.Random(f"verst.calculator/mental_last_step/{seed}")
    out = []
    for problem in problems:
        conversation = problem.metadata.get(CONVERSATION_KEY)
        if not conversation or problem.metadata.get("task") != "calculator":
            raise ValueError(f"mental_last_step needs calculator problems with a gold conversation, got task "
                             f"{problem.metadata.get('task')!r} for prompt {problem.text!r}")
        calls = [m for m in conversation if m.get("tool_calls")]
        last_op = call_operation(calls[-1])[1]
        if len(calls) > 1 and last_op in ops and rng.random() < rate:
            hasty = conversation[:-3] + [conversation[-1]]  # drop the last call and its result
            metadata = {**problem.metadata, CONVERSATION_KEY: hasty, "teacher": "mental last step"}
            problem = dataclasses.replace(problem, metadata=metadata)
        out.append(problem)
    return out
