"""`verst report RUN_DIR [RUN_DIR ...]`: write one run's HTML report, or one report overlaying several runs."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="verst report",
        description="One run: write RUN_DIR/report.html. Several: write one report that overlays them, a colour "
                    "per run (for instance a sync run against a fully async one).")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run directory (holds metrics.jsonl, summary.json, config.yaml)")
    parser.add_argument("--out", default=None,
                        help="where to write the report (default: RUN_DIR/report.html for one run, "
                             "./report-compare.html for several)")
    args = parser.parse_args(argv)
    from verst.monitor.report import COMPARE_FILE, write_compare_report, write_report

    try:
        if len(args.run_dirs) == 1:
            path = write_report(args.run_dirs[0], out=args.out)
        else:
            path = write_compare_report(args.run_dirs, out=args.out or COMPARE_FILE)
    except FileNotFoundError as e:
        print(f"verst report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
