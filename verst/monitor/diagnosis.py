"""How a fault is told: an error's whole text (named by its type when its text is empty), the OS error
inside a chain of exceptions, the free space of the filesystem a path is on, and the command that continues
a stopped run. Standard library only: the trainer ranks, the driver and the reaper's post-mortem use it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

# OS errors that mean "make room, then resume": the disk, a quota, or a tmpfs is full.
NO_SPACE_ERRNOS = frozenset({28, 122})  # ENOSPC, EDQUOT
# An OS error's last line in a traceback carried as text (a trainer rank's, through Ray).
_ERRNO_LINE = re.compile(r"^(\w*Error): \[Errno (\d+)\] ([^\n]*)$", re.MULTILINE)


def error_text(error: BaseException) -> str:
    """`Type: message`, whole and on one line; an error whose message is empty is named by its type alone
    (`ReadError (no message)`), so a reader never sees a bare `ReadError: `."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else f"{type(error).__name__} (no message)"


def headline(error: BaseException) -> str:
    """`error` on one line for a one-screen report: its text whole when it is one line; a text of several
    lines (a remote traceback) as its first and last lines, which name the process and the exception."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return error_text(error)
    return f"{type(error).__name__}: {lines[0]} [...] {lines[-1]}"


def os_error_in(error: BaseException) -> OSError | None:
    """The first OS error (with an errno) in `error`, its causes and contexts, and the failures it wraps
    (torch.distributed.checkpoint's `CheckpointException.failures`: rank -> (exception, traceback))."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        wrapped = getattr(current, "failures", None)
        for item in wrapped.values() if isinstance(wrapped, dict) else ():
            inner = item[0] if isinstance(item, tuple) else item
            if isinstance(inner, BaseException):
                pending.append(inner)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return _os_error_in_text(error)


def _os_error_in_text(error: BaseException) -> OSError | None:
    """The last OS error a traceback in `error`'s text names (an error raised in another process, whose
    exception object did not travel), as an OSError with its errno."""
    found = _ERRNO_LINE.findall(str(error))
    if not found:
        return None
    _, code, message = found[-1]
    strerror, _, filename = message.partition(": '")
    return OSError(int(code), strerror, filename.rstrip("'")) if filename else OSError(int(code), strerror)


def cause_text(error: BaseException) -> str:
    """The OS error behind `error` when there is one (`OSError: [Errno 28] No space left on device`), else
    `error`'s own whole text: the line an operator acts on, without the wrappers' tracebacks."""
    found = os_error_in(error)
    if found is None:
        return error_text(error)
    return f"OSError: [Errno {found.errno}] {found.strerror or os.strerror(found.errno)}" + (
        f": {found.filename!r}" if found.filename else "")


def is_out_of_space(error: BaseException) -> bool:
    found = os_error_in(error)
    return found is not None and found.errno in NO_SPACE_ERRNOS


def free_space(path: str | Path) -> str:
    """'4.3 MB free of 30.0 MB on the filesystem of PATH' (the nearest existing directory above `path`)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as error:
        return f"the free space of {where} cannot be read ({error_text(error)})"
    return f"{_megabytes(usage.free)} free of {_megabytes(usage.total)} on the filesystem of {where}"


def resume_command(prog: str, run_dir: str | Path) -> str:
    return f"verst {prog} --resume {run_dir}"


def _megabytes(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
