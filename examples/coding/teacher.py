"""A scripted teacher for the coding tasks: it reads the files that say what to write (with read_file, or `cat`
through shell when the episode has no read_file tool), writes the solution with edit_file, runs the tests with
shell, and says they pass. Its tool calls run on a real sandbox through the environment's own tools, so each
tool message is what an episode would show the model.

A teacher that takes the shortcut writes the fix without reading the tests first, as an expert who knows the
code would: its transcript is right, but a student that imitates it has nothing to read the fix from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from examples.coding.tools import RUN_TESTS, TOOL_NAMES, run_tool
from verst.sandbox import Sandbox, SandboxProvider
from verst.sandbox.coding_tasks import CodingTask, run_checks

FINAL_ANSWER = "The tests pass."


def teacher_steps(task: CodingTask, tools: Sequence[str] = TOOL_NAMES, shortcut: bool = False
                  ) -> list[tuple[str, dict[str, str]]]:
    """(tool, arguments) of the teacher's calls, in order, with the tools named in `tools`; with the `shortcut`,
    no reads."""
    read_with_cat = "read_file" not in tools
    reads = [] if shortcut else [("shell", {"command": f"cat {path}"}) if read_with_cat else ("read_file", {"path": path})
                                 for path in task.files_to_read]
    edits = [("edit_file", {"path": path, "content": text}) for path, text in task.solution.items()]
    return [*reads, *edits, ("shell", {"command": RUN_TESTS})]


def transcript(task: CodingTask, sandbox: Sandbox, tools: Sequence[str] = TOOL_NAMES, shortcut: bool = False
               ) -> list[dict[str, Any]]:
    """The messages after the prompt (assistant tool calls, tool results, the closing answer) as the teacher
    solves `task` in `sandbox`, a fresh one holding the task's files; refuses a solution whose tests or hidden
    checks fail."""
    conversation: list[dict[str, Any]] = []
    for index, (name, args) in enumerate(teacher_steps(task, tools, shortcut), start=1):
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


def teach(task: CodingTask, provider: SandboxProvider, tools: Sequence[str] = TOOL_NAMES, shortcut: bool = False
          ) -> list[dict[str, Any]]:
    """The teacher's transcript of `task`, solved in a sandbox of its own that is closed afterwards."""
    sandbox = provider.start(task.files)
    try:
        return transcript(task, sandbox, tools, shortcut)
    finally:
        sandbox.close()
