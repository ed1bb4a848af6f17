"""SIGINT and SIGTERM stop a run alike (Ctrl-C; the notice Slurm and Kubernetes send before they kill a job).
The first signal asks an RL run to stop at the end of its train step, after a checkpoint when
`checkpoint.on_signal` allows; past `STOP_GRACE_S`, or at a second signal, the run is cancelled where it is.
A run that cannot stop at a step (`on_signal` off, still starting, or SFT) is cancelled at the first signal.
`verst train` and `verst sft` install the handlers (`StopSignals`); a run reads the request (`STOP`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)
# Kubernetes' default terminationGracePeriodSeconds and Slurm's default KillWait are both 30 s before SIGKILL:
# the step's end and its checkpoint get 20 of them, the processes' shutdown the other 10.
STOP_GRACE_S = 20.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StoppedBySignal(Exception):
    """The run stopped at a step's end because a signal asked it to (its summary and report are written)."""

    def __init__(self, signum: signal.Signals, checkpoint: str):
        super().__init__(f"stopped by {signum.name} at the end of a train step; {checkpoint}")
        self.signum = signum


class StopRequest:
    """The process's stop request (signals are the process's, so there is one: `STOP`). A run `attach`es
    its task when it starts and says, once its loop runs, whether a signal may wait for the step's end."""

    def __init__(self) -> None:
        self.signum: signal.Signals | None = None
        self.at: float | None = None  # perf_counter of the first signal
        self.graceful = False
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def requested(self) -> bool:
        """A signal asked the run to stop at the end of its step."""
        return self.signum is not None and self.graceful

    def seconds_left(self) -> float:
        """Of the grace a signal gives the step's end and its checkpoint."""
        return STOP_GRACE_S - (time.perf_counter() - self.at) if self.at is not None else STOP_GRACE_S

    def attach(self) -> None:
        """The run in the current task starts: a signal cancels it (until `stop_at_steps`)."""
        self.signum, self.at, self.graceful, self._timer = None, None, False, None
        self._task, self._loop = asyncio.current_task(), asyncio.get_running_loop()

    def stop_at_steps(self, on: bool) -> None:
        """The loop runs: with `on` (`checkpoint.on_signal`), a signal waits for the end of the step."""
        self.graceful = on
        if on and self.signum is not None and self._timer is None:  # came while the run was starting
            self._arm()

    def detach(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._task = self._loop = self._timer = None
        self.graceful = False

    def received(self, signum: signal.Signals) -> None:
        """A signal came (from `StopSignals`' handler, in the main thread, which runs the run's loop)."""
        if self.signum is not None or self._task is None:  # the second, or no run to stop at a step: at once
            self.signum = self.signum or signum
            raise KeyboardInterrupt
        self.signum, self.at = signum, time.perf_counter()
        if self.graceful:
            self._loop.call_soon_threadsafe(self._arm)
        else:
            self._loop.call_soon_threadsafe(self._cancel, "")

    def _arm(self) -> None:
        log.warning("%s: the run stops at the end of this train step, saving a checkpoint first "
                    "(checkpoint.on_signal); within %g s, else where it is; send it again to stop now",
                    self.signum.name, STOP_GRACE_S)
        self._timer = self._loop.call_later(max(0.0, self.seconds_left()), self._cancel,
                                            f"the step did not end within {STOP_GRACE_S:g} s of {self.signum.name}")

    def _cancel(self, why: str) -> None:
        if why:
            log.warning("%s: stopping where it is", why)
        if self._task is not None and not self._task.done():
            self._task.cancel()


STOP = StopRequest()


class StopSignals:
    """`with StopSignals(): run(cfg)`: SIGINT and SIGTERM go to `STOP` (main thread only; elsewhere, as
    in a test's background thread, nothing is installed)."""

    def __init__(self, request: StopRequest = STOP):
        self.request = request
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        self.request.signum = None
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request.received(signal.Signals(signum))
