"""The coding environment's tools, as OpenAI schemas and as calls run on a sandbox: `shell(command)`,
`read_file(path)` and `edit_file(path, content)`. A refused call is reported back to the model as text.

The agent (agent.py) and the teacher (teacher.py) run calls through the same `run_tool`, so the teacher's
transcripts hold exactly the tool messages an episode would show the model.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from verst.sandbox import ExecResult, Sandbox, SandboxError

SHELL_TIMEOUT_S = 10.0  # per command; the sandbox kills what is still running then
OUTPUT_CHARS = 1500  # of a command's output or a file shown to the model: small models have small contexts
RUN_TESTS = "python3 run_tests.py"  # what the prompt and the teacher run


def _tool(name: str, description: str, **parameters: str) -> dict[str, Any]:
    properties = {key: {"type": "string", "description": text} for key, text in parameters.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(parameters)}}}


TOOLS: list[dict[str, Any]] = [
    _tool("shell", "Run a shell command in the workspace", command="the command"),
    _tool("read_file", "Read a file of the workspace", path="its path"),
    _tool("edit_file", "Write a file of the workspace", path="its path", content="the whole new text"),
]
TOOL_NAMES = [tool["function"]["name"] for tool in TOOLS]


class ToolError(ValueError):
    """A call the tools cannot run as asked; the message, shown to the model, names what was wrong."""


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
    """The tool message's text, whether the call ran, and a shell call's command and result."""

    content: str
    ok: bool
    command: str | None = None
    result: ExecResult | None = None


def run_tool(sandbox: Sandbox, name: str, arguments: str) -> ToolOutcome:
    """One tool call (its arguments as the JSON text of an OpenAI tool call) run on `sandbox`."""
    try:
        args = parse_arguments(name, arguments)
        if name == "shell":
            result = sandbox.exec(args["command"], SHELL_TIMEOUT_S)
            return ToolOutcome(shell_report(result), True, args["command"], result)
        if name == "read_file":
            return ToolOutcome(cut(sandbox.read_file(args["path"])), True)
        sandbox.write_file(args["path"], args["content"])
        return ToolOutcome(f"wrote {len(args['content'])} characters to {args['path']}", True)
    except (ToolError, SandboxError, OSError, UnicodeDecodeError) as error:
        return ToolOutcome(f"error: {error}", False)


def parse_arguments(name: str, arguments: str) -> dict[str, str]:
    schema = next((tool["function"] for tool in TOOLS if tool["function"]["name"] == name), None)
    if schema is None:
        raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as error:
        raise ToolError(f"{name}: arguments {arguments!r:.80} are not JSON ({error})") from None
    expected = schema["parameters"]["required"]
    if not isinstance(args, dict) or sorted(args) != sorted(expected):
        raise ToolError(f"{name}: arguments must be an object with exactly {', '.join(expected)}; got {args!r:.80}")
    wrong = [key for key in expected if not isinstance(args[key], str)]
    if wrong:
        raise ToolError(f"{name}: {', '.join(wrong)} must be text")
    return args


def shell_report(result: ExecResult) -> str:
    status = f"exit code {result.exit_code}" + (f" (timed out after {SHELL_TIMEOUT_S:g} s)" if result.timed_out else "")
    return f"{status}\n{cut(result.output)}"


def cut(text: str) -> str:
    return text if len(text) <= OUTPUT_CHARS else text[:OUTPUT_CHARS] + f"\n[cut at {OUTPUT_CHARS} characters]"
