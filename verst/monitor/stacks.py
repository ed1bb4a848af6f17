"""Python stacks of live processes, for hang reports: each verst process arms SIGUSR1 to print its
threads' stacks to its stderr (its log file); a reader signals a process and collects what it printed.

Linux only (/proc); a process is signalled only when it shows a SIGUSR1 handler, so nothing is killed.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DUMP_SIGNAL = signal.SIGUSR1


def arm_stack_dump(log_path: str | Path | None = None) -> None:
    """Print every thread's stack to stderr on SIGUSR1 (a C-level handler: works while Python is blocked).
    With `log_path`, this process's output goes there first (`keep_output_in`), and so do its stacks."""
    if log_path is not None:
        keep_output_in(Path(log_path))
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def keep_output_in(path: Path) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2: Python's, C libraries', Ray's own
    worker messages) to `path`, appended: a log in the run directory outlives the run, where Ray's files in the
    run's temporary directory do not. Its lines then do not reach the driver's terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def process_state(pid: int) -> str:
    """'running', 'sleeping', 'stopped', 'zombie', ... from /proc, or 'gone' when there is no such process."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split("(", 1)[-1].rstrip(")").strip() or line.split()[1]
    except OSError:
        pass
    return "gone"


def stderr_path(pid: int) -> str | None:
    """Where `pid` writes its stderr (a Ray worker's .err file, an engine's log), when it is a file."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return None
    return target if target.startswith("/") and Path(target).is_file() else None


def handles_dump_signal(pid: int) -> bool:
    """Whether `pid` catches SIGUSR1 (bit 9 of SigCgt): only then is signalling it harmless."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (DUMP_SIGNAL - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def dump_process_stacks(pid: int, wait_s: float = 1.0) -> str:
    """The Python stacks of `pid`: py-spy's when installed, else what the process's armed handler prints
    to its stderr file; otherwise a line saying why there are none."""
    state = process_state(pid)
    if state == "gone":
        return "(process gone)"
    if state == "stopped":
        return "(process stopped by a signal, e.g. SIGSTOP: it cannot print its stacks)"
    spy = shutil.which("py-spy")
    if spy:
        try:
            done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
            if done.returncode == 0:
                return done.stdout
        except (OSError, subprocess.TimeoutExpired):
            pass
    path = stderr_path(pid)
    if path is None or not handles_dump_signal(pid):
        return "(no stack dump handler or stderr file in this process)"
    start = Path(path).stat().st_size
    os.kill(pid, DUMP_SIGNAL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
    with open(path, "rb") as file:
        file.seek(start)
        text = file.read().decode(errors="replace")
    return text or f"(nothing printed within {wait_s:g} s)"


def dump_own_stacks(path: Path) -> None:
    """This process's threads into `path`."""
    with open(path, "w") as file:
        faulthandler.dump_traceback(file, all_threads=True)


def log_tail(path: str | Path | None, lines: int = 20) -> list[str]:
    """The last `lines` lines of a log file (none when it is missing)."""
    if path is None:
        return []
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(file.tell() - 64 * 1024, 0))
            text = file.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]
