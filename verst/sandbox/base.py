"""The sandbox protocol: start from a task's files, exec with a time limit, read and write files, close."""

from dataclasses import dataclass
from enum import Enum
from pathlib import PurePosixPath
from typing import Protocol


class SandboxError(RuntimeError):
    """A sandbox could not be started or used as asked."""


class Lifetime(str, Enum):
    """How long one sandbox lives, chosen in the recipe: one per trajectory, per group or per run."""

    TRAJECTORY = "trajectory"
    GROUP = "group"
    RUN = "run"


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome: exit code, captured output (capped), and whether a limit ended it."""

    exit_code: int
    output: str
    timed_out: bool = False
    truncated: bool = False


def workspace_relative(path: str, workspace: str) -> PurePosixPath:
    """`path` relative to the workspace: a relative path, or an absolute one inside it; `..` is refused."""
    relative: PurePosixPath | None = PurePosixPath(path)
    if relative.is_absolute():
        relative = relative.relative_to(workspace) if relative.is_relative_to(workspace) else None
    if relative is None or ".." in relative.parts:
        raise SandboxError(f"path {path!r} is outside the workspace {workspace}")
    return relative


def capped(output: bytes, cap: int) -> tuple[str, bool]:
    """The first `cap` bytes of `output` as text, and whether more was there."""
    return output[:cap].decode(errors="replace"), len(output) > cap


class Sandbox(Protocol):
    closed: bool  # set by close(), or by the sandbox itself when a limit ends it

    def exec(self, command: str, timeout_s: float) -> ExecResult: ...

    def read_file(self, path: str) -> str: ...

    def write_file(self, path: str, text: str) -> None: ...

    def close(self) -> None: ...


class SandboxProvider(Protocol):
    def start(self, files: dict[str, str]) -> Sandbox: ...
