"""The calculator task: problems and their gold tool-using conversations, the safe calculator, the
agent's tool step, and the final-answer reward."""

import ast
import asyncio
import operator
import random
import re

import pytest

from examples.calculator.agent import run_tool
from examples.calculator.make_data import make_data
from examples.calculator.reward import final_answer
from verst.data import TASKS, load_prompts, make_splits, write_jsonl
from verst.data.calculator import (
    CALCULATOR_TOOL,
    CONVERSATION_KEY,
    ToolError,
    calculate,
    calculator_problem,
    call_expression,
    parse_expression,
    step,
)
from verst.data.teachers import mental_last_step
from verst.rewards import RewardError
from verst.types import Sample

_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate_expression(text: str) -> int:
    """An independent check of the written precedence: Python's parser, only +, -, * on integers."""

    def walk(node):
        if isinstance(node, ast.BinOp):
            return _AST_OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
        return node.value

    return walk(ast.parse(text, mode="eval").body)


def test_gold_conversation_steps_the_calculator_to_the_label():
    rng = random.Random(3)
    for _ in range(300):
        text, label, meta = calculator_problem(rng, min_steps=2, max_steps=4, max_operand=20)
        assert text.endswith("=") and evaluate_expression(text[:-1]) == int(label), text
        conversation = meta[CONVERSATION_KEY]
        calls, results = conversation[0:-1:2], conversation[1:-1:2]
        assert len(calls) == len(results) == len(parse_expression(text[:-1])[1])  # one call per operation
        left = text[:-1]
        for call, result in zip(calls, results):
            (tool_call,) = call["tool_calls"]
            assert call_expression(call) == left  # each call sends what the calculator left
            assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": step(left)}
            left = result["content"]
        assert conversation[-1] == {"role": "assistant", "content": label} and left == label
        assert meta["tools"] == [CALCULATOR_TOOL] and meta["task"] == "calculator" and "(" not in text


@pytest.mark.parametrize("expression, after", [
    ("7*3-5", "21-5"), ("21-5", "16"), ("2+3*4", "2+12"), ("3*4*5", "12*5"), ("9-8-5", "1-5"),
    ("-4+5", "1"), (" -3 - -2 ", "-1"), ("-4*-2", "8"), ("7", "7"),
])
def test_step_carries_out_one_operation(expression, after):
    assert step(expression) == after
    left = expression
    while parse_expression(left)[1]:
        left = step(left)
    assert int(left) == evaluate_expression(expression.strip())


def test_default_problems_are_short_two_step_single_digit():
    text, label, meta = calculator_problem(random.Random(0))
    assert len(text) == 6 and len(meta[CONVERSATION_KEY]) == 5, (text, meta[CONVERSATION_KEY])


def test_task_splits_round_trip_through_jsonl(tmp_path):
    assert "calculator" in TASKS
    train, test = make_splits("calculator", n_train=300, n_test=50, seed=1)
    assert not {p.text for p in train} & {p.text for p in test}
    assert make_splits("calculator", n_train=10, n_test=50, seed=1)[1] == test  # test split depends on n_test only
    write_jsonl(test, tmp_path / "test.jsonl")
    loaded = load_prompts(tmp_path / "test.jsonl")
    assert loaded[0].prompt == [{"role": "user", "content": test[0].text}] and loaded[0].label == test[0].label
    assert loaded[0].metadata["tools"] == [CALCULATOR_TOOL]
    assert loaded[0].metadata[CONVERSATION_KEY] == test[0].metadata[CONVERSATION_KEY]


def test_calculate_accepts_json_text_and_objects():
    assert calculate('{"expression": "7*6-2"}') == "42-2"
    assert calculate({"expression": " -3 - 9 "}) == "-12"
    assert parse_expression("21-5*2") == ([21, 5, 2], ["-", "*"])


@pytest.mark.parametrize("arguments, names", [
    ('{"expression": "1/2"}', "expression = '1/2'"),
    ({"expression": "(1+2)*3"}, "expression = '(1+2)*3'"),  # no brackets
    ({"expression": "2**9"}, "expression = '2**9'"),
    ({"expression": "1234567890*2"}, "expression = '1234567890*2'"),
    ({"expression": "+".join("1" * 10)}, "at most 8 operations"),
    ({"expression": 12}, "expression = 12"),
    ({}, "expression = None"),
    ({"expression": "1+2", "x": 3}, "unknown arguments ['x']"),
    ('{"expression": ', "not JSON"),
    ("[1, 2]", "must be an object"),
])
def test_calculate_refuses_bad_arguments_by_name(arguments, names):
    with pytest.raises(ToolError, match=re.escape(names)):
        calculate(arguments)


def test_agent_tool_step_reports_errors_to_the_model():
    assert run_tool("calculator", '{"expression": "2+3"}') == ("5", True)
    assert run_tool("calculator", '{"expression": "2*3+1"}') == ("6+1", True)
    text, ok = run_tool("calculator", '{"expression": "2^3"}')
    assert not ok and text.startswith("error:") and "'2^3'" in text
    text, ok = run_tool("search", "{}")
    assert not ok and "unknown tool 'search'" in text


def _scored(answer, label="-15", **extra):
    sample = Sample(label=label, metadata={"final_answer": answer, **extra} if answer != "absent" else extra)
    return asyncio.run(final_answer(sample))


def test_final_answer_reward():
    assert _scored("-15") == 1.0
    assert _scored("The answer is -15.") == 1.0
    assert _scored("15") == 0.0
    assert _scored(None) == 0.0  # the episode ended without an answer
    assert _scored("") == 0.0
    with pytest.raises(RewardError, match="no 'final_answer'"):
        _scored("absent")
    with pytest.raises(RewardError, match="label 'x' is not a number"):
        _scored("3", label="x")


def test_mental_last_step_teacher_skips_only_the_last_addition():
    train, _ = make_splits("calculator", n_train=600, n_test=10, seed=0)
    taught = mental_last_step(train, rate=0.75, ops="+")
    assert [p.text for p in taught] == [p.text for p in train] and [p.label for p in taught] == [p.label for p in train]
    changed = 0
    for before, after in zip(train, taught):
        gold, demo = before.metadata[CONVERSATION_KEY], after.metadata[CONVERSATION_KEY]
        last_op = parse_expression(call_expression(gold[-3]))[1][0]
        if "teacher" in after.metadata:
            changed += 1
            assert last_op == "+" and demo == gold[:2] + gold[-1:]  # one call, its result, the right answer
        else:
            assert demo == gold
    ends_with_add = sum(parse_expression(p.metadata["expression"])[1][-1] == "+" for p in train)
    assert 0.6 * ends_with_add < changed < 0.9 * ends_with_add
    assert mental_last_step(train, rate=0.75, ops="+")[5] == taught[5]  # seeded
    with pytest.raises(ValueError, match="rate must be in"):
        mental_last_step(train, rate=1.5)
    with pytest.raises(ValueError, match="ops = '/'"):
        mental_last_step(train, rate=0.5, ops="/")


def test_make_data_writes_the_splits_and_the_teacher_file(tmp_path):
    paths = make_data(tmp_path, n_train=50, n_test=10)
    train, test, teacher = (load_prompts(paths[k]) for k in ("train", "test", "sft_teacher"))
    assert (len(train), len(test), len(teacher)) == (50, 10, 50)
    assert [p.prompt for p in teacher] == [p.prompt for p in train]
    assert any("teacher" in p.metadata for p in teacher) and not any("teacher" in p.metadata for p in train)
