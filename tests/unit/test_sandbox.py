"""The local bubblewrap sandbox: it runs commands in its workspace, and escapes are tried and fail."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verst.sandbox import BubblewrapProvider, SandboxError, SandboxLimits


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def sandbox(tmp_path):
    box = BubblewrapProvider(SandboxLimits(cpu_s=5, processes=32, file_bytes=2 * 2**20, output_bytes=4096,
                                           workspace_bytes=4 * 2**20)).start({"a.py": "x = 1\n"})
    yield box
    box.close()


def test_exec_reads_and_writes_the_workspace(sandbox):
    result = sandbox.exec("cat a.py && echo y = 2 > b.py && exit 3", timeout_s=10)
    assert (result.exit_code, result.output) == (3, "x = 1\n")
    assert sandbox.read_file("b.py") == "y = 2\n"
    sandbox.write_file("sub/c.py", "z\n")
    assert sandbox.exec("cat /tmp/workspace/sub/c.py", 10).output == "z\n"
    with pytest.raises(SandboxError, match="outside the workspace"):
        sandbox.read_file("../etc/passwd")


def test_writes_outside_the_workspace_fail(sandbox, tmp_path):
    home = Path.home() / "verst-sandbox-escape"
    result = sandbox.exec(f"touch {home}; touch /etc/verst-escape; echo ok > /tmp/t; cat /tmp/t", 10)
    assert not home.exists() and not Path("/etc/verst-escape").exists()
    assert "Read-only file system" in result.output and result.output.endswith("ok\n")
    assert not any(p.name == "t" for p in Path("/tmp").glob("t"))


def test_no_network(sandbox):
    code = ("import socket; s = socket.socket(); s.settimeout(2)\n"
            "try:\n s.connect(('127.0.0.1', 22)); print('connected')\nexcept OSError as e: print('refused', e)")
    result = sandbox.exec(f"/usr/bin/python3 -c \"{code}\"; tail -n +3 /proc/net/dev | cut -d: -f1", 20)
    assert "connected" not in result.output and "refused" in result.output
    assert result.output.split()[-1] == "lo"  # only the loopback of its own net namespace


def test_fork_bomb_is_contained(sandbox):
    started = time.monotonic()
    result = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 1; echo survived", timeout_s=5)
    assert time.monotonic() - started < 20
    assert "Cannot fork" in result.output  # the process limit refused the bomb's forks
    assert sandbox.exec("echo after", 10).output == "after\n"


def test_filling_the_disk_is_stopped(sandbox):
    result = sandbox.exec("head -c 50000000 /dev/zero > big; echo $?", 10)
    assert Path(sandbox.workspace, "big").stat().st_size <= 2 * 2**20
    assert result.exit_code != 0 or result.output.strip() != "0"
    with pytest.raises(SandboxError, match="over its limit"):
        sandbox.exec("for i in 1 2 3; do head -c 1500000 /dev/zero > f$i; done", 10)
    assert not Path(sandbox.workspace).exists()


def test_output_and_time_are_capped(sandbox):
    result = sandbox.exec("yes", timeout_s=2)
    assert result.timed_out or result.truncated
    assert len(result.output) <= 4096 and result.truncated
    slow = sandbox.exec("sleep 30", timeout_s=1)
    assert slow.timed_out


def test_a_background_process_does_not_outlive_close(sandbox):
    started = time.monotonic()
    assert sandbox.exec("sleep 300 & echo started", 10).output == "started\n"
    assert time.monotonic() - started < 10  # the exec ends with its shell; its pid namespace takes the rest
    before = len(sandbox.pids)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(sandbox.exec("sleep 300 & sleep 300", 600)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60  # generous: the suite may run on a loaded machine
    while (len(sandbox.pids) <= before or len(descendants(sandbox.pids[-1])) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sandbox.pids) > before, "the second exec never started"
    recorded = [sandbox.pids[-1]] + descendants(sandbox.pids[-1])
    nobody = subprocess.run(["ps", "-u", "65534", "-o", "pid,ppid,stat,cmd"], capture_output=True, text=True).stdout
    assert len(recorded) >= 3 and all(alive(p) for p in recorded), (recorded, outcome, nobody[-2000:])
    sandbox.close()
    worker.join(timeout=10)
    assert [p for p in recorded if alive(p)] == []
    with pytest.raises(SandboxError, match="closed"):
        sandbox.exec("true", 1)


DRIVER = """
import sys, time
from verst.sandbox import BubblewrapProvider
box = BubblewrapProvider().start({})
import subprocess, threading
threading.Thread(target=box.exec, args=("echo $$ > /tmp/workspace/inner; sleep 300", 600), daemon=True).start()
while not box.pids: time.sleep(0.05)
print(box.pids[0], box.workspace, flush=True)
time.sleep(300)
"""


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(c) for c in out] + [g for c in out for g in descendants(int(c))]


def test_a_killed_driver_leaves_no_sandbox_process(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        pid, workspace = driver.stdout.readline().split()
        bwrap_pid = int(pid)
        deadline = time.monotonic() + 20
        while not Path(workspace, "inner").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        recorded = [bwrap_pid] + descendants(bwrap_pid)
        assert len(recorded) >= 2, recorded  # bwrap and the command under it
        assert all(alive(p) for p in recorded)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in recorded) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in recorded if alive(p)] == []
    finally:
        driver.kill()
        driver.wait()
        shutil.rmtree(workspace, ignore_errors=True)


def test_no_user_namespaces_is_refused_by_name(monkeypatch):
    import verst.sandbox.local as local

    failed = subprocess.CompletedProcess([], 1, "", "bwrap: No permissions to create new namespace")
    monkeypatch.setattr(local.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(SandboxError, match="bubblewrap cannot run here.*No permissions.*no unsandboxed fallback"):
        BubblewrapProvider()
