"""The reaper: a small process, in a session of its own, that ends every process a run started and
removes the run's temporary directory when the driver goes away, even when it is killed (SIGKILL); then it
writes the killed run's summary.json and report.html (`verst.monitor.postmortem`).

The driver holds the write end of the reaper's stdin: end of file without "done" means the driver died;
"run RUN_DIR" names the run in progress ("run -": none). Meanwhile the reaper records the driver's
descendants (pid and start time, from /proc) every half second.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
POSTMORTEM_TIMEOUT_S = 120.0  # its imports (plotly) and a long run's report take seconds, not minutes


class Reaper:
    """The driver's handle: `Reaper.start(tmp_dir)`, then `done()` after a clean shutdown."""

    def __init__(self, proc: subprocess.Popen, tmp_dir: Path):
        self.proc, self.tmp_dir = proc, tmp_dir

    @classmethod
    def start(cls, tmp_dir: Path) -> Reaper:
        # Run as a file, not a module of the package: it imports nothing but the standard library.
        cmd = [sys.executable, __file__, "--pid", str(os.getpid()), "--dir", str(tmp_dir)]
        # Its own session: a signal to the driver's process group (Ctrl-C, a group kill) does not reach it.
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        return cls(proc, tmp_dir)

    def watch_run(self, run_dir: Path | None) -> None:
        """The run in progress (None: none), whose summary and report the reaper writes if the driver dies."""
        self._send(f"run {run_dir if run_dir is not None else '-'}\n".encode())

    def _send(self, line: bytes) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except OSError:
            pass  # the reaper is gone: nothing to tell

    def done(self, timeout_s: float = 30.0) -> None:
        """The run ended cleanly: the reaper ends what is left that names the temporary directory, removes
        it, and exits."""
        if self.proc.stdin is None or self.proc.stdin.closed:
            return
        self._send(b"done\n")
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- /proc ------------------------------------------------------------------------------------------
def process_table() -> dict[int, tuple[int, int]]:
    """Every process: pid -> (parent pid, start time in clock ticks since boot)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[int]:
    found, frontier = set(), set(roots)
    while frontier:
        children = {pid for pid, (ppid, _) in table.items() if ppid in frontier and pid not in found}
        found |= children
        frontier = children
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---- the reaper process ----------------------------------------------------------------------------
def watch(driver: int, tmp_dir: Path) -> None:
    me = os.getpid()
    table = process_table()
    started = table.get(driver, (0, 0))[1]
    existing = descendants({driver}, table)  # the driver's children from before the run are not its own
    tracked: dict[int, int] = {}  # pid -> start time
    run_dir: str | None = None  # the run in progress
    pending = b""  # read from stdin, not yet a whole line
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], POLL_S)
        table = process_table()
        for pid in descendants({driver} | set(tracked), table) - existing - {me}:
            tracked.setdefault(pid, table[pid][1])
        if readable:
            chunk = os.read(stdin, 4096)  # unbuffered: several lines may come in one read
            if not chunk:  # end of file: the driver is gone
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.strip() == b"done":
                    finish(tracked, tmp_dir, only_naming=str(tmp_dir))
                    return
                if line.startswith(b"run "):
                    named = line[4:].strip().decode()
                    run_dir = None if named == "-" else named
        if table.get(driver, (0, -1))[1] != started:  # gone (or its pid reused)
            break
    finish(tracked, tmp_dir)
    if run_dir is not None:
        postmortem(run_dir)


def postmortem(run_dir: str) -> None:
    """The killed run's summary.json and report.html, written by `verst.monitor.postmortem` (which imports
    verst: the reaper itself stays on the standard library), its output in RUN_DIR/logs/postmortem.log."""
    log = Path(run_dir) / "logs" / "postmortem.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            subprocess.run([sys.executable, "-m", "verst.monitor.postmortem", run_dir], stdout=out,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=POSTMORTEM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        pass  # nobody is left to tell; `verst report RUN_DIR` writes the report by hand


def finish(tracked: dict[int, int], tmp_dir: Path, only_naming: str | None = None) -> None:
    """SIGKILL the tracked processes still alive (their start time matches; with `only_naming`, only
    those whose command line names it) and their descendants; then remove `tmp_dir`."""
    table = process_table()
    alive = {pid for pid, start in tracked.items() if table.get(pid, (0, -1))[1] == start}
    victims = alive | descendants(alive, table)
    if only_naming is not None:
        victims = {pid for pid in victims if only_naming in cmdline(pid)}
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in victims):
        time.sleep(0.1)  # a killed process may still hold files open in the directory
    shutil.rmtree(tmp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pid", type=int, required=True, help="the driver's pid")
    parser.add_argument("--dir", type=Path, required=True, help="the run's temporary directory")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(args.pid, args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
