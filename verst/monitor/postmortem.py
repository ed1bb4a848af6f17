"""`python -m verst.monitor.postmortem RUN_DIR`: summary.json and report.html of a run whose driver was killed
(SIGKILL, the OOM killer), from what its directory holds: metrics.jsonl, segments.json and config.yaml. The
reaper runs it once it has ended the run's processes; `verst report RUN_DIR` redraws the report any time.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from verst.monitor.report import write_report
from verst.monitor.run_dir import CONFIG_FILE, read_metrics, write_summary
from verst.monitor.segments import mark_killed

log = logging.getLogger(__name__)
SCORE_KEYS = ("eval/accuracy", "eval/success")
KILLED_END = "killed: the driver ended without stopping the run (summary written by its reaper)"


def killed_summary(run_dir: Path) -> dict[str, Any]:
    """What ran, as summary.json tells a finished run: steps, held-out scores before and after (with the
    versions measured), the time over every segment, the schedule and transport, and how it ended."""
    records = read_metrics(run_dir)
    segments = mark_killed(run_dir)
    steps = max((int(r["step"]) for r in records if "train/loss" in r), default=0)
    config_file = run_dir / CONFIG_FILE
    config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.is_file() else {}
    summary: dict[str, Any] = {
        "train/steps": steps, "time/total_s": sum(segment.seconds for segment in segments),
        "segments": [segment.row() for segment in segments], "stopped": KILLED_END,
        "schedule": config.get("schedule"), "sync/transport": (config.get("sync") or {}).get("transport"),
    }
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
