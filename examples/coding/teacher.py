"""A scripted teacher for the coding tasks: it reads each file the solution changes, writes the solution with
edit_file, runs the tests with shell, and says they pass. Its tool calls run on a real sandbox through the
environment's own tools, so each tool message is what an episode would show the model."""

from __future__ import annotations

import json
from typing import Any

from examples.coding.tools import RUN_TESTS, run_tool
from verst.sandbox import Sandbox, SandboxProvider
from verst.sandbox.coding_tasks import CodingTask, run_checks

FINAL_ANSWER = "The tests pass."


def teacher_steps(task: CodingTask) -> list[tuple[str, dict[str, str]]]:
    """(tool, arguments) of the teacher's calls, in order."""
    reads = [("read_file", {"path": path}) for path in task.solution]
    edits = [("edit_file", {"path": path, "content": text}) for path, text in task.solution.items()]
    return [*reads, *edits, ("shell", {"command": RUN_TESTS})]


def transcript(task: CodingTask, sandbox: Sandbox) -> list[dict[str, Any]]:
    """The messages after the prompt (assistant tool calls, tool results, the closing answer) as the teacher
    solves `task` in `sandbox`, a fresh one holding the task's files; refuses a solution whose tests or hidden
    checks fail."""
    conversation: list[dict[str, Any]] = []
    for index, (name, args) in enumerate(teacher_steps(task), start=1):
        call_id = f"call_{index}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        outcome = run_tool(sandbox, name, call["function"]["arguments"])
        if not outcome.ok:
            raise RuntimeError(f"task {task.name}: the teacher's {name} call failed: {outcome.content}")
        conversation += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call_id, "content": outcome.content}]
    last = outcome.result
    if last is None or last.exit_code != 0 or "PASSED" not in last.output or not tests_all_pass(last.output):
        raise RuntimeError(f"task {task.name}: the teacher's solution does not pass its tests: {outcome.content!r:.300}")
    checks = run_checks(sandbox, task.checks)
    if checks.passed != checks.total:
        raise RuntimeError(f"task {task.name}: the teacher's solution fails hidden checks: {checks.output:.300}")
    return conversation + [{"role": "assistant", "content": FINAL_ANSWER}]


def tests_all_pass(output: str) -> bool:
    passed, _, total = output.strip().splitlines()[-1].removeprefix("PASSED ").partition("/")
    return passed == total


def teach(task: CodingTask, provider: SandboxProvider) -> list[dict[str, Any]]:
    """The teacher's transcript of `task`, solved in a sandbox of its own that is closed afterwards."""
    sandbox = provider.start(task.files)
    try:
        return transcript(task, sandbox)
    finally:
        sandbox.close()
