"""One metrics logger, several sinks: metrics.jsonl (always), TensorBoard, Weights & Biases.

Keys are flat and namespaced (`rollout/`, `buffer/`, `train/`, `sync/`, `eval/`, `perf/`, `time/`).
"""

from __future__ import annotations

import json
import logging
import numbers
import time
from pathlib import Path
from typing import Any, Protocol

from verst.monitor.diagnosis import cause_text
from verst.monitor.run_dir import METRICS_FILE

log = logging.getLogger(__name__)
NAMESPACES = ("rollout", "buffer", "train", "sync", "eval", "perf", "time", "fault", "lora")  # lora/<name>/...: multi-LoRA


class MetricsSink(Protocol):
    where: str  # what a failed write names: a file, a directory, a service

    def write(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class MetricsWriteError(RuntimeError):
    """A sink could not write a row (a full disk, an I/O error); the message names the sink's file, the
    step and the OS error (the OSError is its cause)."""


class JsonlSink:
    """Appends one JSON object per log call: {"step": k, "time": t, ...metrics}."""

    def __init__(self, run_dir: Path):
        self.where = str(Path(run_dir) / METRICS_FILE)
        self._file = open(self.where, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard's own event-file writer, which needs no torch: a run's driver never imports torch."""

    def __init__(self, run_dir: Path):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.where = str(Path(run_dir) / "tensorboard")
        self._writer = EventFileWriter(self.where)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=key, simple_value=value) for key, value in metrics.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, project: str, name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("logging.wandb = true but the wandb package is not installed (pip install wandb)") from None
        self._run = wandb.init(project=project, name=name, dir=str(run_dir), config=config)
        self.where = f"Weights & Biases (project {project!r}, files in {run_dir})"

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    """Validates keys and values, then fans out to every sink."""

    def __init__(self, sinks: list[MetricsSink]):
        self._sinks = sinks

    @classmethod
    def for_run(cls, run_dir: Path, *, tensorboard: bool = True, wandb: bool = False,
                wandb_project: str = "verst", name: str = "run", config: dict[str, Any] | None = None) -> MetricsLogger:
        sinks: list[MetricsSink] = [JsonlSink(run_dir)]
        if tensorboard:
            sinks.append(TensorBoardSink(run_dir))
        if wandb:
            sinks.append(WandbSink(run_dir, wandb_project, name, config or {}))
        return cls(sinks)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            namespace = key.split("/", 1)[0]
            if "/" not in key or namespace not in NAMESPACES:
                raise ValueError(f"metric key {key!r} must start with one of {[n + '/' for n in NAMESPACES]}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"metric {key!r} has non-numeric value {value!r}")
            clean[key] = float(value)
        for sink in self._sinks:
            try:
                sink.write(step, clean)
            except OSError as error:
                raise MetricsWriteError(f"the metrics of step {step} were not written to {sink.where}: "
                                        f"{cause_text(error)}") from error

    def close(self) -> None:
        """Close every sink; a sink that cannot flush (a full disk) does not keep the others open."""
        errors = []
        for sink in self._sinks:
            try:
                sink.close()
            except OSError as error:
                errors.append(f"{sink.where}: {cause_text(error)}")
        if errors:
            raise MetricsWriteError("metrics not flushed to " + "; ".join(errors))

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the error in flight is the one to tell; a sink that cannot flush as well is logged
            self.close()
        except MetricsWriteError as error:
            log.error("%s", error)


