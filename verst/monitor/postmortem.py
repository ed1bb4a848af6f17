"""summary.json and report.html of a run that did not finish: `write_stopped` for one stopped by an error or a
signal (its driver writes them), and `python -m verst.monitor.postmortem RUN_DIR` for one whose driver was
killed (SIGKILL, the OOM killer), from what its directory holds: metrics.jsonl, segments.json, config.yaml.
The reaper runs the latter once it has ended the run's processes; `verst report RUN_DIR` redraws the report.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from verst.monitor.diagnosis import cause_text
from verst.monitor.report import write_report
from verst.monitor.run_dir import CONFIG_FILE, read_metrics, write_summary
from verst.monitor.segments import Segment, mark_killed

log = logging.getLogger(__name__)
SCORE_KEYS = ("eval/accuracy", "eval/success")
KILLED_END = "killed: the driver ended without stopping the run (summary written by its reaper)"


def write_stopped(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """Write `summary` (with `stopped` and what ran) and the report; the lines that say what was written, or
    why not (a full disk, metrics a report cannot read). Never raises: the run's own error is the one to tell."""
    steps, seconds = summary.get("train/steps", 0), summary.get("time/total_s", 0.0)
    segments = summary.get("segments") or []
    over = f" over {len(segments)} segments" if len(segments) > 1 else ""
    lines = [f"what ran: {steps} train steps in {seconds:.0f} s{over}"]
    try:
        lines.append(f"summary: {write_summary(run_dir, summary)}")
    except Exception as error:
        lines.append(f"summary.json not written: {cause_text(error)}")
    try:
        lines.append(f"report: {write_report(run_dir)}")
    except Exception as error:
        lines.append(f"report.html not written: {cause_text(error)}; write it later with: verst report {run_dir}")
    return lines


def killed_summary(run_dir: Path) -> dict[str, Any]:
    """A killed RL run's summary (the reaper's): what ran, with its last segment "killed"."""
    return summary_of(run_dir, mark_killed(run_dir), KILLED_END, rl=True)


def summary_of(run_dir: Path, segments: list[Segment], end: str, *, rl: bool) -> dict[str, Any]:
    """What ran, from the run directory, as summary.json tells a finished run: steps, held-out scores before
    and after (with the versions measured), the time over every segment, for RL the schedule and transport,
    and `stopped` (how it ended)."""
    records = read_metrics(run_dir)
    steps = max((int(r["step"]) for r in records if "train/loss" in r), default=0)
    summary: dict[str, Any] = {
        "train/steps": steps, "time/total_s": sum(segment.seconds for segment in segments),
        "segments": [segment.row() for segment in segments], "stopped": end,
    }
    if rl:
        config_file = run_dir / CONFIG_FILE
        config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.is_file() else {}
        summary |= {"schedule": config.get("schedule"), "sync/transport": (config.get("sync") or {}).get("transport")}
    for key in SCORE_KEYS:
        scored = [r for r in records if key in r]
        if scored:
            first, last = scored[0], scored[-1]
            summary |= {f"{key}_before": first[key], f"{key}_after": last[key],
                        "eval/version_before": first["step"], "eval/version_after": last["step"]}
            break
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    run_dir = parser.parse_args(argv).run_dir
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not run_dir.is_dir():
        log.error("postmortem: %s is not a run directory", run_dir)
        return 2
    summary = write_summary(run_dir, killed_summary(run_dir))
    log.info("postmortem of %s: %s, %s", run_dir, summary, write_report(run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
