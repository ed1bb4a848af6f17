"""The coding environment's agent fn (official `openai` client): in the episode's sandbox, which holds the task's
files, the model calls the shell, read_file and edit_file tools until it answers without a tool call or reaches
the turn limit; then the task's tests and hidden checks grade the workspace.

verst calls `run(base_url, prompt, request_kwargs, metadata, sandbox=...)` with `sandbox.provider` set in the
recipe, which also chooses the sandbox's lifetime; the row's metadata carries the task (`files`, `test_files`,
the tools' schemas and, when the task has them, its hidden `checks`). The dict it returns is merged into the
sample's metadata, where the reward (reward.py) reads `pass_fraction`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from examples.coding.tools import OUTPUT_CHARS, run_tool
from verst.monitor.samples import OUTCOME_KEY
from verst.sandbox import Sandbox
from verst.sandbox.coding_tasks import Check, TestReport, run_checks, run_tests

MAX_TURNS = 8  # model calls per episode: the teacher's transcript takes 4 (read, edit, test, answer)
TIMEOUT = openai.Timeout(600.0, connect=60.0)  # the session server shares a busy process with every episode


async def run(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any], *,
              sandbox: Sandbox | None = None) -> dict[str, Any]:
    """One episode; returns {"pass_fraction" (the grade: the hidden checks passing, or without checks the
    visible tests), "checks_passed", "checks_total", "tests_passed", "tests_total", "outcome" (the grade and
    the tests' output, shown in the run report), "commands" (each shell call's command, exit code and output),
    "agent_turns", "tool_calls", "tool_errors", "agent_end": "answer" | "length" | "max_turns"}."""
    if sandbox is None:
        raise ValueError("the coding agent runs in a sandbox: set sandbox.provider (e.g. 'local') in the recipe")
    missing = [key for key in ("files", "test_files", "tools") if key not in metadata]
    if missing:
        raise ValueError(f"the coding agent needs the task in the sample's metadata; missing {missing} "
                         f"(keys {sorted(metadata)}); write the data with examples.coding.make_data")
    # blocking sandbox calls run in threads, off the event loop that the session server shares
    result = await episode(sandbox, base_url, prompt, request_kwargs, metadata["tools"])
    checks = [Check(**check) for check in metadata.get("checks", [])]
    tests, hidden = await asyncio.to_thread(grade_workspace, sandbox, metadata["files"], metadata["test_files"],
                                            checks)
    grade = (f"tests {tests.passed}/{tests.total}" + (f", hidden checks {hidden.passed}/{hidden.total}" if hidden else "")
             + f"; {result['tool_calls']} tool calls, ended by {result['agent_end']}")
    return {**result, "pass_fraction": (hidden or tests).fraction, "checks_passed": hidden.passed if hidden else 0,
            "checks_total": len(checks), "tests_passed": tests.passed, "tests_total": tests.total,
            OUTCOME_KEY: f"{grade}\n{tests.output.strip()[-OUTPUT_CHARS:]}"}


async def episode(sandbox: Sandbox, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                  tools: list[dict[str, Any]]) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    result: dict[str, Any] = {"commands": [], "agent_turns": 0, "tool_calls": 0, "tool_errors": 0,
                              "agent_end": "max_turns"}
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        for _ in range(MAX_TURNS):
            completion = await client.chat.completions.create(model="verst", messages=messages, tools=tools,
                                                              **request_kwargs)
            result["agent_turns"] += 1
            choice = completion.choices[0]
            messages.append(choice.message.model_dump(exclude_none=True))
            if choice.finish_reason == "length":  # cut off mid-turn, or no room left in the context
                result["agent_end"] = "length"
                break
            if not choice.message.tool_calls:
                result["agent_end"] = "answer"
                break
            for call in choice.message.tool_calls:
                outcome = await asyncio.to_thread(run_tool, sandbox, call.function.name, call.function.arguments)
                result["tool_calls"] += 1
                result["tool_errors"] += not outcome.ok
                if outcome.result is not None:
                    result["commands"].append({"command": outcome.command, "exit_code": outcome.result.exit_code,
                                               "output": outcome.result.output[:OUTPUT_CHARS]})
                messages.append({"role": "tool", "tool_call_id": call.id, "content": outcome.content})
    return result


def grade_workspace(sandbox: Sandbox, files: dict[str, str], test_files: list[str], checks: list[Check]
                    ) -> tuple[TestReport, TestReport | None]:
    """The task's tests run on the workspace, after the test files are put back as the task gave them (an
    episode that rewrote the tests or the runner is graded by the task's own), and its hidden checks (None
    without): a project that prints the runner's verdict itself passes no check."""
    for path in test_files:
        sandbox.write_file(path, files[path])
    return run_tests(sandbox), run_checks(sandbox, checks) if checks else None
