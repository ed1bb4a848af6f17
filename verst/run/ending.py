"""How an RL run that stops before its end ends: the background work is dropped, summary.json and the report
are written with what ran, and the error becomes one screen that names what failed, the OS error, the
latest checkpoint and what to do (free space under the run directory, `verst train --resume RUN_DIR`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from verst.monitor import checkpoint_dirs as layout
from verst.monitor.diagnosis import cause_text, free_space, os_error_in, resume_command
from verst.orchestration.watchdog import RunFailure
from verst.run.rl_run import RLRun
from verst.run.signals import STOP, StoppedBySignal

log = logging.getLogger(__name__)
Explain = Callable[[BaseException], Awaitable[RunFailure | None]]  # the dead processes' screen, if any died


async def end_early(run: RLRun, error: BaseException, explain: Explain) -> BaseException:
    """The exception to raise for `run` stopped by `error`: an interrupt (a signal, Ctrl-C, a cancel) as it
    came; a failure as a one-screen `RunFailure` when it is an operator's to act on (a process died, a phase
    hung, a save or a metrics row that could not be written), else the error itself (a bug: its traceback
    is the story). Either way the run's summary.json and report tell what ran before it stopped."""
    run.checkpointer.abandon()  # a commit waiting for a dead rank's write must not hold the exit
    await run.checkpointer.settle()  # one already writing ends: the latest checkpoint named below is final
    await run.evaluator.drop()
    await run.weights.close_within(10.0)  # a dead or stuck part must not hold the report back
    interrupted = not isinstance(error, Exception) or isinstance(error, StoppedBySignal)
    run_dir = run.monitor.run_dir
    failure = None if interrupted else await _screen(run_dir, error, explain)
    end = interruption(error) if interrupted else \
        "failed: " + (str(failure).splitlines()[0].removeprefix("run stopped: ") if failure else cause_text(error))
    written = await asyncio.to_thread(run.monitor.stopped, run.version, run.evaluator.history, run.lanes,
                                      run.evaluator.score_key, end)
    if failure is None:
        log.info("%s; %s", end, "; ".join(written))
        return error
    return _extended(failure, [*(f"  {line}" for line in written), *_resume_lines(failure, run_dir)])


def interruption(error: BaseException) -> str:
    """'interrupted by SIGTERM' (the signal that stopped the run), or 'interrupted' (a cancel)."""
    if isinstance(error, StoppedBySignal):
        return f"interrupted by {error.signum.name}"
    return f"interrupted by {STOP.signum.name}" if STOP.signum is not None else "interrupted"


async def _screen(run_dir: Path, error: BaseException, explain: Explain) -> RunFailure | None:
    """The one screen for `error`, or None when it is not an operator's (it is raised as it is)."""
    if isinstance(error, RunFailure):
        return error
    dead = await explain(error)
    if dead is not None:
        return dead
    if isinstance(error, layout.CheckpointNotSaved):
        return _written_failure(run_dir, str(error), error.out_of_space or os_error_in(error) is not None)
    if os_error_in(error) is not None:  # a row of metrics, summary.json, a file of the run directory
        return _written_failure(run_dir, str(error) or cause_text(error), True)
    return None


def _written_failure(run_dir: Path, message: str, disk: bool) -> RunFailure:
    """A write into the run directory failed: the message and the free space there."""
    lines = [f"run stopped: {message}"]
    if disk:
        lines.append(f"  free space: {free_space(run_dir)}")
    return RunFailure("\n".join(lines))


def _resume_lines(failure: RunFailure, run_dir: Path) -> list[str]:
    """How to continue: from the latest checkpoint (after making room, when a write failed)."""
    if "continue with:" in str(failure):
        return []
    latest = layout.read_latest(run_dir)
    room = f"make room under {run_dir}, then " if "free space:" in str(failure) else ""
    if latest is None:
        return [f"  no checkpoint to continue from (checkpoint.interval = 0 or none saved yet): {room}start the "
                "run again"]
    return [f"  continue with: {room}{resume_command('train', run_dir)} (from {latest})"]


def _extended(failure: RunFailure, lines: list[str]) -> RunFailure:
    """`failure` with `lines` below its message; its type and fields (a `StuckError`'s dump) stay."""
    failure.args = ("\n".join([str(failure), *lines]),)
    return failure
