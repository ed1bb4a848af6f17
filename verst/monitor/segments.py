"""A run's segments: each time a run went on in its directory (its start, each `--resume`, each restart after
a trainer rank died) with its wall-clock seconds, the steps it went from and to, and how it ended, in
RUN/segments.json. A run's totals (`time/total_s`) are over all of its segments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

SEGMENTS_FILE = "segments.json"
RUNNING, FINISHED, KILLED = "running", "finished", "killed"  # `end` of a segment (or "interrupted by ...", "failed: ...")


@dataclasses.dataclass
class Segment:
    started_at: float  # Unix time
    seconds: float  # wall-clock, start-up included; a killed segment's, up to its last logged step
    from_step: int  # the version it started at (a resumed segment: its checkpoint's)
    to_step: int  # the last version it logged
    end: str = RUNNING

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Segments:
    """The segments of the run in `run_dir`: those recorded before (one left "running" is a driver that was
    killed: it becomes "killed"), and this one, open since `started` (perf_counter) at Unix time
    `started_at`. `update` and `close` rewrite the file, so a killed driver leaves its last step's numbers."""

    def __init__(self, run_dir: Path, started: float, started_at: float, from_step: int = 0):
        self.path = Path(run_dir) / SEGMENTS_FILE
        self.before = [_ended(segment) for segment in read_segments(run_dir)]
        self.started = started
        self.current = Segment(started_at, 0.0, from_step, from_step)

    def begin(self, version: int) -> None:
        """The loop starts at `version` (a resumed run: its checkpoint's)."""
        self.current.from_step = self.current.to_step = version
        self.write()

    def update(self, version: int) -> None:
        self.current.to_step = version
        self.write()

    def close(self, end: str) -> None:
        self.current.end = end
        self.write()

    @property
    def all(self) -> list[Segment]:
        self.current.seconds = time.perf_counter() - self.started
        return [*self.before, self.current]

    @property
    def total_s(self) -> float:
        return sum(segment.seconds for segment in self.all)

    def write(self) -> None:
        rows = [segment.row() for segment in self.all]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        os.replace(tmp, self.path)


def read_segments(run_dir: Path) -> list[Segment]:
    """The segments recorded in `run_dir` (none when it holds no segments.json)."""
    path = Path(run_dir) / SEGMENTS_FILE
    if not path.is_file():
        return []
    return [Segment(**row) for row in json.loads(path.read_text())]


def mark_killed(run_dir: Path) -> list[Segment]:
    """After the driver was killed (the reaper's post-mortem): the segment it left "running" is "killed"."""
    segments = [_ended(segment) for segment in read_segments(run_dir)]
    if segments:
        path = Path(run_dir) / SEGMENTS_FILE
        path.write_text(json.dumps([segment.row() for segment in segments], indent=1) + "\n")
    return segments


def _ended(segment: Segment) -> Segment:
    return dataclasses.replace(segment, end=KILLED) if segment.end == RUNNING else segment
