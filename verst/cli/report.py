"""`verst report RUN_DIR`: write the run's HTML report with PNG plots and print its path."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="verst report", description="Write RUN_DIR/report.html with plots.")
    parser.add_argument("run_dir", help="run directory (holds metrics.jsonl, summary.json, config.yaml)")
    args = parser.parse_args(argv)
    from verst.monitor.report import write_report

    try:
        path = write_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"verst report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
