"""What a stopped run says: the driver's watchdog over each phase (a step, a sync, an evaluation, an
engine call), the stacks of every verst process when one overruns, and one-screen failure reports.

`RunProcesses` knows every process of a run (engines, trainer ranks, rollout manager, router) and tells
which died and how; `Watchdog.guard` bounds a phase and, past its limit, dumps stacks and raises `StuckError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from verst.monitor.diagnosis import headline
from verst.monitor.stacks import dump_own_stacks, dump_process_stacks, log_tail, process_state, stderr_path

T = TypeVar("T")
TAIL_LINES = 20


class RunFailure(RuntimeError):
    """A run stopped by a dead or stuck process; the message says which, how, and where its log is.
    `dead` holds the roles of the processes that died ("trainer-0", "engine-1", "rollout-manager")."""

    def __init__(self, message: str, dead: tuple[str, ...] = ()):
        super().__init__(message)
        self.dead = dead

    @property
    def trainer_died(self) -> bool:
        return any(role.startswith("trainer-") for role in self.dead)


class StuckError(RunFailure, TimeoutError):
    """A phase made no progress within its limit; `dump_dir` holds the stacks of every verst process."""

    def __init__(self, message: str, phase: str, dump_dir: Path):
        super().__init__(message)
        self.phase, self.dump_dir = phase, dump_dir


@dataclasses.dataclass
class ProcessStatus:
    """One process of a run: `exit` is None while it lives, else how it ended."""

    name: str  # "engine 1 (http://127.0.0.1:40123)", "trainer rank 0", "rollout manager", "router"
    role: str  # file-name stem of its stack dump
    pid: int | None
    log: str | None
    state: str  # process_state(), or "dead"
    exit: str | None = None
    node: str | None = None  # the address of its Ray node (None: the driver's)
    node_id: str | None = None

    def line(self) -> str:
        how = f"died: {self.exit}" if self.exit else self.state
        return f"{self.name}, pid {self.pid}: {how}" + (f"; log {self.log}" if self.log else "")


def describe_exit(returncode: int | None) -> str | None:
    """'killed by SIGKILL' or 'exited with code 1' for a Popen return code; None while running."""
    if returncode is None:
        return None
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class RunProcesses:
    """The processes of one RL run, surveyed from the driver: the pids of processes on its machine (`node`,
    its Ray node's address; None: all) are read in /proc; those on other machines are listed, not surveyed."""

    def __init__(self, run_dir: Path, engines: Any, trainer: Any, rollout: Any, log_dir: Path, node: str | None = None):
        self.run_dir, self.engines, self.trainer, self.rollout, self.log_dir = run_dir, engines, trainer, rollout, log_dir
        self.node = node
        self._logs: dict[int, str | None] = {}  # pid -> its stderr file, remembered while it lives
        self._written: list[dict[str, Any]] | None = None  # what processes.json holds

    def changes(self) -> list[dict[str, Any]] | None:
        """Note where each new live Ray-hosted process writes its stderr (readable only while it lives); the
        processes' listing (names, pids, logs) when it differs from what `processes.json` holds, else None (in
        memory and /proc only: no file is written)."""
        listed = []
        for status in self._static():
            if status.pid is not None and status.pid not in self._logs and self._here(status):
                self._logs[status.pid] = stderr_path(status.pid)
            listed.append({"name": status.name, "pid": status.pid, "log": status.log or self._logs.get(status.pid),
                           "node": status.node, "node_id": status.node_id})
        return None if listed == self._written else listed

    def write(self, listed: list[dict[str, Any]]) -> None:
        """`processes.json` in the run directory holds `listed` (from `changes`)."""
        _write_json(self.run_dir / "processes.json", listed)
        self._written = listed

    def survey(self, timeout_s: float = 5.0) -> list[ProcessStatus]:
        """Every known process with its state; the engines' servers are asked through their actors."""
        statuses = self._static()
        engine_status = _safe(lambda: self.engines.status(timeout_s), [])
        for status in statuses:
            status.log = status.log or self._logs.get(status.pid or -1)
            if status.role.startswith("engine-") and not status.role.endswith("actor"):
                index = int(status.role.split("-")[1])
                reported = engine_status[index] if index < len(engine_status) else {}
                status.exit = describe_exit(reported.get("returncode"))
            if not self._here(status):
                status.state = f"on node {status.node} (not surveyed from the driver's machine)"
                continue
            state = process_state(status.pid) if status.pid is not None else "unknown"
            status.state = state
            if status.exit is None and state in ("gone", "zombie"):
                status.exit = "died (its exit status is not known to the driver)"
        return statuses

    def dead(self, error: BaseException | None = None) -> list[ProcessStatus]:
        """The processes that died. Trainer ranks the driver stopped itself (after a rank failed) are not
        counted, except the rank `error` (a `RankError`) names as dead."""
        stopped = bool(getattr(self.trainer, "_closed", False))
        named = getattr(error, "rank", None) if "process died" in str(error) else None
        return [status for status in self.survey() if status.exit
                and not (stopped and status.role.startswith("trainer-") and status.role != f"trainer-{named}")]

    def all_pids(self) -> list[tuple[str, int]]:
        return [(s.role, s.pid) for s in self._static() if s.pid is not None and self._here(s)]

    def _here(self, status: ProcessStatus) -> bool:
        """On the driver's machine: its /proc shows the process."""
        return self.node is None or status.node is None or status.node == self.node

    def _static(self) -> list[ProcessStatus]:
        out = []
        infos = _safe(lambda: self.engines.infos, [])
        for info in infos:
            index, url = info["index"], info["url"]
            log = str(self.log_dir / f"engine-{index}.log")
            where = {"node": info.get("node"), "node_id": info.get("node_id")}
            out.append(ProcessStatus(f"engine {index} ({url})", f"engine-{index}", info.get("server_pid"), log, "",
                                     **where))
            out.append(ProcessStatus(f"engine {index}'s actor", f"engine-{index}-actor", info.get("actor_pid"), None,
                                     "", **where))
        for info in _safe(lambda: self.trainer.ready_infos, []):
            out.append(ProcessStatus(f"trainer rank {info['rank']}", f"trainer-{info['rank']}", info["pid"], None, "",
                                     node=info.get("node"), node_id=info.get("node_id")))
        rollouts = self.rollout if isinstance(self.rollout, (list, tuple)) else [self.rollout]  # one per adapter
        for index, rollout in enumerate(rollouts):
            pids, tag = getattr(rollout, "pids", {}) or {}, f"-{index}" if index else ""
            # the manager and its router run on the driver's node (see RolloutManagerHandle)
            where = {"node": getattr(rollout, "node", None), "node_id": getattr(rollout, "node_id", None)}
            if pids.get("manager"):
                out.append(ProcessStatus(f"rollout manager{tag}", f"rollout-manager{tag}", pids["manager"], None, "",
                                         **where))
            if pids.get("router"):
                out.append(ProcessStatus(f"router{tag} ({getattr(rollout, 'router_url', '')})", f"router{tag}",
                                         pids["router"], None, "", **where))
        return out


class Watchdog:
    """Bounds the phases of a run. Past a limit: stacks into `run_dir/stacks/`, then `StuckError`."""

    def __init__(self, run_dir: Path, processes: RunProcesses | None):
        self.run_dir, self.processes = run_dir, processes
        self._failure: RunFailure | None = None
        self._failed: asyncio.Event | None = None

    def fail(self, failure: RunFailure) -> None:
        """Stop the run with `failure` (from the engine supervisor): the phase in progress, or the next one,
        raises it."""
        self._failure = failure
        self._event().set()

    async def guard(self, phase: str, limit_s: float, field: str, awaitable: Awaitable[T]) -> T:
        """`await awaitable`, or `StuckError` naming `phase` and its limit's config `field` after `limit_s`
        (or the failure given to `fail`)."""
        if self.processes is not None:  # the file is written only when a process came or went
            listed = _safe(self.processes.changes, None)
            if listed is not None:
                await asyncio.to_thread(_safe, lambda: self.processes.write(listed), None)
        task = asyncio.ensure_future(awaitable)
        failed = asyncio.ensure_future(self._event().wait())
        try:
            done, _ = await asyncio.wait({task, failed}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # the run is cancelled (Ctrl-C): the phase ends with it, not as an orphan task
            raise
        finally:
            failed.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if self._failure is not None:
            raise self._failure
        raise await self.stuck(phase, limit_s, field)

    async def stuck(self, phase: str, limit_s: float, field: str) -> StuckError:
        """Dump every process's stacks and describe the hang of `phase` (past `limit_s`, set by `field`)."""
        dump_dir = await asyncio.to_thread(self.dump, phase)
        lines = [f"run stopped: {phase} made no progress within {limit_s:g} s ({field})",
                 f"  stacks of every verst process: {dump_dir} (they show where it waits; if it is only slow, "
                 f"raise {field})"]
        if self.processes is not None:
            statuses = await asyncio.to_thread(self.processes.survey)
            lines += [f"  {status.line()}" for status in statuses]
        return StuckError("\n".join(lines), phase, dump_dir)

    def _event(self) -> asyncio.Event:
        if self._failed is None:  # made on the run's event loop, at first use
            self._failed = asyncio.Event()
        return self._failed

    def dump(self, phase: str) -> Path:
        """The driver's threads and every verst process's stacks, one file each, in a new directory."""
        slug = re.sub(r"[^a-z0-9]+", "-", phase.lower()).strip("-")
        out = self.run_dir / "stacks" / f"{time.strftime('%Y%m%d-%H%M%S')}-{slug}"
        out.mkdir(parents=True, exist_ok=True)
        dump_own_stacks(out / f"driver-{os.getpid()}.txt")
        pids = self.processes.all_pids() if self.processes is not None else []
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            texts = list(pool.map(lambda item: dump_process_stacks(item[1]), pids))
        for (role, pid), text in zip(pids, texts):
            (out / f"{role}-{pid}.txt").write_text(f"# {role}, pid {pid}, state {process_state(pid)}\n{text}")
        return out


def failure_report(processes: RunProcesses, error: BaseException, phase: str | None = None) -> RunFailure | None:
    """A one-screen `RunFailure` when a process of the run died (None when none did): what died, how,
    the end of its log, and the error it caused."""
    dead = _safe(lambda: processes.dead(error), [])
    if not dead:
        return None
    lines = ["run stopped: " + "; ".join(f"{status.name} (pid {status.pid}) {status.exit}" for status in dead)]
    for status in dead:
        tail = log_tail(status.log, TAIL_LINES)
        if status.log:
            lines.append(f"  {status.name}: log {status.log}" + (f", last {len(tail)} lines:" if tail else ""))
            lines += [f"    | {line}" for line in tail]
    lines.append(f"  what the run saw{f' in {phase}' if phase else ''}: {headline(error)}")
    latest = processes.run_dir / "checkpoints" / "latest"
    if latest.exists():
        lines.append(f"  last checkpoint: {latest}")
    return RunFailure("\n".join(lines), dead=tuple(status.role for status in dead))


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def _safe(fn: Any, default: Any) -> Any:
    """`fn()`, or `default` when it fails: a report must not fail on the part that broke."""
    try:
        return fn()
    except Exception:
        return default
