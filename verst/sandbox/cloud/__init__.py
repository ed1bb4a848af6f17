"""Sandboxes run by a cloud service (Daytona, E2B, Modal), each through its own Python SDK, imported only
when its provider is built; what they share: the options every one takes, credentials, output caps, errors.
"""

import importlib
import os
import shlex
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from verst.sandbox.base import ExecResult, SandboxError, capped, workspace_relative

# A command a service's own time limit ended reports the exit code of a SIGKILL, as the local provider's does.
TIMED_OUT_EXIT = -signal.SIGKILL


@dataclass(frozen=True)
class CloudOptions:
    """What every cloud provider takes: where the task's files go, how much output is kept, how long a sandbox
    may live, and whether its commands reach the network."""

    workspace: str = "/tmp/workspace"  # on every service's images writable by the sandbox's default user
    output_bytes: int = 64 * 2**10  # output kept per exec, as the local provider's default
    lifetime_s: int = 3600  # the service ends the sandbox after this long, even if close() is never called
    network: bool = False  # the sandbox's commands reach the internet (the local provider never does)

    def remote_path(self, path: str) -> str:
        """The absolute path in the sandbox of a workspace path (refused outside the workspace)."""
        return f"{self.workspace}/{workspace_relative(path, self.workspace)}"


def shell_argv(command: str) -> list[str]:
    """`command` under /bin/sh, as the local provider runs it, with stderr merged into stdout in arrival order."""
    return ["/bin/sh", "-c", f"exec 2>&1\n{command}"]


def shell_line(command: str) -> str:
    """`shell_argv` as one line, for services that take a command string."""
    return shlex.join(shell_argv(command))


def credential(explicit: str | None, variable: str, provider: str) -> str:
    """An explicit credential, else the SDK's usual environment variable; neither is a `SandboxError` naming it."""
    value = explicit or os.environ.get(variable)
    if not value:
        raise SandboxError(f"the {provider} sandbox provider needs a credential: set {variable} or pass it explicitly")
    return value


def sdk(module: str, provider: str, extra: str):
    """The provider's SDK module, or a `SandboxError` naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise SandboxError(f"the {provider} sandbox provider needs the {module} package "
                           f"(pip install 'verst[{extra}]')") from error


@contextmanager
def service_call(provider: str, operation: str, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Turns the service's errors during `operation` into a `SandboxError` naming the provider and the operation."""
    try:
        yield
    except errors as error:
        raise SandboxError(f"{provider} {operation} failed: {type(error).__name__}: {error}") from error


class OutputSink:
    """Collects a command's output chunks in arrival order, keeping at most `cap + 1` bytes."""

    def __init__(self, cap: int):
        self.cap, self.kept = cap, bytearray()

    def add(self, chunk: str | bytes) -> None:
        data = chunk.encode() if isinstance(chunk, str) else chunk
        room = self.cap + 1 - len(self.kept)
        if room > 0:
            self.kept += data[:room]

    def result(self, exit_code: int, timed_out: bool = False) -> ExecResult:
        output, truncated = capped(bytes(self.kept), self.cap)
        return ExecResult(TIMED_OUT_EXIT if timed_out else exit_code, output, timed_out, truncated)
