"""The fully async background worker: keeps up to `max_in_flight` trajectories generating across
training steps and puts each finished group into the data buffer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal, Protocol

from verst.config import RolloutConfig
from verst.rollout.admission import StalenessGate
from verst.rollout.buffer import DataBuffer
from verst.types import Group, Sample, Status

logger = logging.getLogger(__name__)

GenerateSample = Callable[[Sample], Awaitable[Sample]]
"""`async generate_sample(sample) -> Sample`: one trajectory (and its reward), from a fresh prompt copy."""
GenerateGroup = Callable[[Group], Awaitable[Group]]
"""`async generate_group(group) -> Group`: every trajectory of one prompt, same length and order."""
FinishGroup = Callable[[Group], Awaitable[None]]
"""`async finish_group(group)`: runs on each generated group before the buffer (e.g. a group reward)."""
Granularity = Literal["sample", "group"]
GENERATE_ERROR_KEY = "generate_error"  # sample.metadata key holding why generation gave up


class GroupSource(Protocol):
    def next_groups(self, n_prompts: int, n_samples_per_prompt: int) -> list[Group]: ...


class _Flight:
    """One group in generation: its samples (replaced by results as they finish) and its task."""

    def __init__(self, group: Group):
        self.group = list(group)
        self.done = [False] * len(group)
        self.task: asyncio.Task | None = None


class AsyncRolloutWorker:
    """Generates groups in the background until stopped; the buffer's blocking `put` is the backpressure.

    Replacement rules (Miles report, Sec. 2.2.1): with `group` granularity a group's whole share of
    the limit stays taken until its last sample ends; with `sample` granularity (default) each
    finished sample frees its place at once, and a new group starts as soon as a whole group's
    places are free. Finished groups reach the buffer in the order they finished.

    Exactly one of `generate_sample` (per-sample; needed for sample granularity) or `generate_group`
    is given. An exception raised by generation makes the sample (or the whole group, for
    `generate_group` and `finish_group`) ABORTED with the reason in `metadata['generate_error']`,
    counted in `rollout/generate_errors_total`; the buffer then discards the group. Anything else that
    goes wrong (a wrong return type, a buffer or filter error) stops the worker, and the error is
    raised from `check()`, `take()` and `stop()`.
    """

    def __init__(
        self,
        source: GroupSource,
        buffer: DataBuffer,
        *,
        n_samples_per_prompt: int,
        max_in_flight: int,
        granularity: Granularity = "sample",
        generate_sample: GenerateSample | None = None,
        generate_group: GenerateGroup | None = None,
        finish_group: FinishGroup | None = None,
        on_leftover: Callable[[Group], None] | None = None,
        admission: StalenessGate | None = None,
    ):
        if (generate_sample is None) == (generate_group is None):
            raise ValueError("AsyncRolloutWorker: give exactly one of generate_sample or generate_group")
        if granularity not in ("sample", "group"):
            raise ValueError(f"AsyncRolloutWorker: granularity = {granularity!r} is not 'sample' or 'group'")
        if granularity == "sample" and generate_sample is None:
            raise ValueError("AsyncRolloutWorker: granularity 'sample' needs generate_sample (per-sample completion)")
        if n_samples_per_prompt < 1 or max_in_flight < n_samples_per_prompt:
            raise ValueError(
                f"AsyncRolloutWorker: max_in_flight = {max_in_flight} must be >= n_samples_per_prompt = "
                f"{n_samples_per_prompt} >= 1 (a group starts only when all its places are free)"
            )
        self._source, self._buffer = source, buffer
        self.n, self.max_in_flight, self.granularity = n_samples_per_prompt, max_in_flight, granularity
        self._generate_sample, self._generate_group = generate_sample, generate_group
        self._finish_group, self._on_leftover = finish_group, on_leftover
        self._admission = admission
        self._flights: list[_Flight] = []  # started, not yet handed to the buffer
        self._finished: list[_Flight] = []  # generated, waiting for buffer.put
        self._reserved = 0  # places taken under the replacement rule
        self._generating = 0  # samples whose generation has not ended (what the engines see)
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._groups_produced = self._samples_produced = self._generate_errors = 0
        self._tokens_in_window = 0  # response tokens of the groups finished since the window start
        self._busy_area = 0.0  # ∫ generating dt since the window start
        self._clock = time.monotonic  # the event loop's clock once started
        self._window_start = self._last_change = self._clock()

    @classmethod
    def from_config(cls, cfg: RolloutConfig, source: GroupSource, buffer: DataBuffer, **kw) -> AsyncRolloutWorker:
        """Granularity and limits from `rollout.*`; max_in_flight defaults to one batch of samples."""
        limit = cfg.max_in_flight if cfg.max_in_flight is not None else cfg.batch_size * cfg.n_samples_per_prompt
        return cls(
            source, buffer, n_samples_per_prompt=cfg.n_samples_per_prompt, max_in_flight=limit,
            granularity=cfg.submission_granularity, **kw,
        )

    # ---- control -------------------------------------------------------------------------
    def start(self) -> asyncio.Task:
        if self._task is not None:
            raise RuntimeError("AsyncRolloutWorker.start: already started")
        self._clock = asyncio.get_running_loop().time
        self._window_start = self._last_change = self._clock()
        self._task = asyncio.create_task(self._run(), name="rollout-worker")
        self._task.add_done_callback(self._record_failure)
        return self._task

    def pause(self) -> None:
        """Start no new group; in-flight groups finish and still reach the buffer."""
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()
        self._wake.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    @property
    def in_flight(self) -> int:
        """Samples whose generation has not ended."""
        return self._generating

    def check(self) -> None:
        """Raise the error that stopped the worker, if any."""
        if self._error is not None:
            raise RuntimeError("rollout worker failed") from self._error

    async def take(self, n: int, current_version: int, timeout: float | None = None) -> list[Group]:
        """`buffer.take`, but raise at once if the worker dies meanwhile instead of waiting forever."""
        self.check()
        if self._task is None or self._task.done():
            raise RuntimeError("AsyncRolloutWorker.take: the worker is not running (use buffer.take to drain)")
        if self._admission is not None:
            self._admission.observe_take(current_version)
            self._wake.set()  # a newer version: more groups may start
        taking = asyncio.ensure_future(self._buffer.take(n, current_version, timeout))
        try:
            await asyncio.wait({taking, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not taking.done():
                taking.cancel()
                await asyncio.gather(taking, return_exceptions=True)
        if taking.cancelled():
            self.check()
            raise RuntimeError("rollout worker ended while the trainer waited for groups")
        self._wake.set()  # room in the buffer, and (admission) a newer version to count from
        return taking.result()

    async def stop(self) -> list[Group]:
        """Cancel all generation; return the groups that never reached the buffer (unfinished samples
        ABORTED with reason 'stopped'), after passing each to `on_leftover`. Re-raises a worker error."""
        tasks = [f.task for f in self._flights if f.task is not None]
        if self._task is not None:
            tasks.append(self._task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        leftovers = []
        for flight in self._flights:
            for i, s in enumerate(flight.group):
                if not flight.done[i]:
                    _mark_aborted(s, "stopped")
            leftovers.append(flight.group)
            if self._on_leftover is not None:
                self._on_leftover(flight.group)
        self._flights, self._finished = [], []
        self._set_generating(0)
        self._reserved = 0
        self.check()
        return leftovers

    # ---- checkpoints ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        """For a checkpoint, without stopping: the groups not yet in the buffer (still generating, or
        generated and waiting for room), whose prompts a resumed run serves again, and the cumulative
        counters. Synchronous, so it sees one consistent moment of the event loop."""
        return {
            "in_flight": [list(f.group) for f in self._flights],
            "counters": {"groups": self._groups_produced, "samples": self._samples_produced,
                         "errors": self._generate_errors},
        }

    def load_counters(self, counters: dict) -> None:
        """Continue the cumulative counters of a checkpoint's `snapshot`."""
        self._groups_produced, self._samples_produced = counters["groups"], counters["samples"]
        self._generate_errors = counters["errors"]

    # ---- metrics -------------------------------------------------------------------------
    def progress(self) -> dict[str, int]:
        """Groups handed to the buffer since the start, and samples generating now (no window is reset)."""
        return {"groups_finished": self._groups_produced, "generating": self._generating}

    def metrics(self) -> dict[str, float]:
        """`*_total` counters are cumulative over the run (groups_produced_total: groups handed to the
        buffer, kept or discarded); slot_occupancy is the time-weighted mean of generating samples / limit
        since the previous `metrics()` call (or `start()`). With `generate_group` a group counts as n until it returns.
        `perf/rollout_tokens_per_s`: response tokens of the groups finished in that window, per second."""
        now = self._clock()
        self._set_generating(self._generating, now)
        span = now - self._window_start
        occupancy = self._busy_area / (span * self.max_in_flight) if span > 0 else 0.0
        tokens_per_s = self._tokens_in_window / span if span > 0 else 0.0
        self._busy_area, self._window_start, self._tokens_in_window = 0.0, now, 0
        return {
            "perf/rollout_tokens_per_s": tokens_per_s,
            "rollout/in_flight": float(self._generating),
            "rollout/max_in_flight": float(self.max_in_flight),
            "rollout/slot_occupancy": occupancy,
            "rollout/groups_produced_total": float(self._groups_produced),
            "rollout/samples_produced_total": float(self._samples_produced),
            "rollout/generate_errors_total": float(self._generate_errors),
        } | (self._admission.metrics() if self._admission is not None else {})

    # ---- the loop ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            while self._finished:
                flight = self._finished[0]
                # Blocks while the buffer is full: no new group starts until the trainer takes one.
                await self._buffer.put(flight.group)
                self._finished.pop(0)
                self._flights.remove(flight)
                if self._admission is not None:
                    self._admission.observe_group(flight.group)
                self._groups_produced += 1
                self._samples_produced += len(flight.group)
                self._tokens_in_window += sum(s.response_length for s in flight.group)
            self.check()
            if self._resumed.is_set():
                while self._reserved + self.n <= self.max_in_flight and self._admits():
                    self._launch()
            await self._wake.wait()
            self._wake.clear()

    def _admits(self) -> bool:
        """Staleness-aware admission (when given): the group would be taken within the staleness limit."""
        return self._admission is None or self._admission.admits(len(self._flights))

    def _launch(self) -> None:
        groups = self._source.next_groups(1, self.n)
        if len(groups) != 1 or len(groups[0]) != self.n:
            shape = [len(g) for g in groups]
            raise ValueError(f"source.next_groups(1, {self.n}) returned groups of sizes {shape}; expected [{self.n}]")
        flight = _Flight(groups[0])
        self._flights.append(flight)
        self._reserved += self.n
        self._set_generating(self._generating + self.n)
        flight.task = asyncio.create_task(self._run_group(flight), name=f"rollout-group-{flight.group[0].group_index}")
        flight.task.add_done_callback(self._record_failure)

    async def _run_group(self, flight: _Flight) -> None:
        if self._generate_sample is not None:
            async with asyncio.TaskGroup() as samples:  # a failing sample task cancels its siblings
                for i in range(self.n):
                    samples.create_task(self._run_sample(flight, i))
        else:
            await self._run_whole_group(flight)
        if self.granularity == "group":
            self._release(self.n)
        if self._finish_group is not None:
            try:
                await self._finish_group(flight.group)
            except Exception as e:  # designed recovery: the group is aborted and counted
                self._abort_group(flight, e, "finish_group")
        self._finished.append(flight)
        self._wake.set()

    async def _run_sample(self, flight: _Flight, i: int) -> None:
        sample = flight.group[i]
        try:
            result = await self._generate_sample(sample)
        except Exception as e:  # designed recovery: the sample is aborted and counted
            self._count_error(e, sample, "generate_sample")
            result = sample
            _mark_aborted(result, f"generate_sample raised {e!r}")
        if not isinstance(result, Sample):
            got = type(result).__name__
            raise TypeError(f"generate_sample returned {got} for sample {sample.index}; expected Sample")
        flight.group[i], flight.done[i] = result, True
        self._set_generating(self._generating - 1)
        if self.granularity == "sample":
            self._release(1)

    async def _run_whole_group(self, flight: _Flight) -> None:
        try:
            result = await self._generate_group(list(flight.group))
        except Exception as e:  # designed recovery: the group is aborted and counted
            self._abort_group(flight, e, "generate_group")
            result = flight.group
        if not isinstance(result, list) or len(result) != self.n or not all(isinstance(s, Sample) for s in result):
            raise TypeError(f"generate_group returned {result!r:.200}; expected a list of {self.n} Samples")
        flight.group, flight.done = list(result), [True] * self.n
        self._set_generating(self._generating - self.n)

    def _abort_group(self, flight: _Flight, error: Exception, where: str) -> None:
        self._count_error(error, flight.group[0], where, n=len(flight.group))
        for s in flight.group:
            _mark_aborted(s, f"{where} raised {error!r}")

    def _count_error(self, error: Exception, sample: Sample, where: str, n: int = 1) -> None:
        self._generate_errors += n
        logger.warning("%s failed for group %d (sample %d): %r", where, sample.group_index, sample.index, error)

    def _release(self, places: int) -> None:
        self._reserved -= places
        self._wake.set()

    def _record_failure(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self._wake.set()  # the loop (if alive) raises it through check()

    def _set_generating(self, value: int, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        self._busy_area += self._generating * (now - self._last_change)
        self._generating, self._last_change = value, now


def _mark_aborted(sample: Sample, reason: str) -> None:
    sample.status = Status.ABORTED
    sample.metadata[GENERATE_ERROR_KEY] = reason
