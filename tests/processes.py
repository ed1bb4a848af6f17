"""Test helpers for processes a test started: whether one still runs, and waiting until some are gone."""

import time


def alive(pid: int) -> bool:
    """Running (a zombie left for its parent to reap has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout=20.0) -> list[int]:
    """The pids still running after `timeout` seconds (empty once all have exited)."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
