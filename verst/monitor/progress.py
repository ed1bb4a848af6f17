"""The live progress display of a training run: a rich bar with the step's headline metrics on a
terminal, one plain line per step elsewhere (CI logs, pipes), nothing when disabled.
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# (metric, label, format) shown for each step when the metric is present.
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("train/loss", "loss", "{:.4f}"),
    ("eval/accuracy", "eval", "{:.1%}"),
    ("eval/success", "success", "{:.1%}"),  # agent tasks: held-out episode success
    ("buffer/staleness_max", "stale", "{:.0f}"),
    ("buffer/queue_size", "queue", "{:.0f}"),
    ("perf/rollout_tokens_per_s", "tok/s", "{:.0f}"),
    ("perf/step_time_s", "step", "{:.2f} s"),
)


EVAL_KEYS = ("eval/accuracy", "eval/success")


def headline(metrics: dict[str, Any], last_eval: dict[str, float] | None = None) -> str:
    """`reward 0.512, loss 0.0031, eval 61.0%, ...` for the metrics a step logged; a held-out score
    missing from this step is taken from `last_eval`."""
    parts = []
    for key, label, fmt in HEADLINE:
        value = metrics.get(key)
        if key in EVAL_KEYS and value is None:
            value = (last_eval or {}).get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
    return ", ".join(parts)


class RunProgress:
    """`with RunProgress("fully_async", total_steps) as progress: progress.step(version, metrics)`.

    `mode`: "auto" (a live bar on a terminal, lines otherwise), "live", "lines" or "off". In lines mode a
    line is printed every `line_every` steps, at the last step and whenever the step has an eval result.
    """

    def __init__(
        self, title: str, total: int, *, mode: str = "auto", stream: TextIO | None = None, line_every: int = 1
    ):
        if line_every < 1:
            raise ValueError(f"RunProgress: line_every must be >= 1, got {line_every}")
        self.line_every = line_every
        if mode not in ("auto", "live", "lines", "off"):
            raise ValueError(f"RunProgress: mode must be auto, live, lines or off, got {mode!r}")
        self.title, self.total = title, total
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "live" if self.stream.isatty() else "lines"
        self.mode = mode
        self.last_eval: dict[str, float] = {}  # the latest held-out scores, shown until the next evaluation
        self._progress: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> RunProgress:
        if self.mode == "live":
            console = Console(file=self.stream, force_terminal=True)
            self._progress = Progress(
                TextColumn(f"[bold]{self.title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[headline]}"),
                console=console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.title, total=self.total, headline="starting")
        return self

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        """Show step `step` (1-based) of `total` with its metrics."""
        for key in EVAL_KEYS:
            if isinstance(metrics.get(key), int | float):
                self.last_eval[key] = float(metrics[key])
        if self.mode == "live" and self._progress is not None:
            self._progress.update(self._task, completed=step, headline=headline(metrics, self.last_eval))
        elif self.mode == "lines" and (
            step % self.line_every == 0 or step == self.total or any(key in metrics for key in EVAL_KEYS)
        ):
            self._line(f"step {step}/{self.total}: {headline(metrics)}")

    def evaluated(self, step: int, metrics: dict[str, Any]) -> None:
        """A held-out evaluation of step `step` finished (in the background, while later steps ran)."""
        scores = {key: float(metrics[key]) for key in EVAL_KEYS if isinstance(metrics.get(key), int | float)}
        self.last_eval.update(scores)
        if self.mode == "lines" and scores:
            self._line(f"step {step} evaluated: {headline(scores)}")

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _line(self, text: str) -> None:
        self.stream.write(f"[{self.title}] {text}\n")
        self.stream.flush()
