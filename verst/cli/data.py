"""`verst data make TASK --n N --out DIR`: write a procedural task's train.jsonl and test.jsonl.

Imports only the data package (no torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verst.data import TASKS, DataError, make_splits, write_jsonl


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verst data", description="Make prompt datasets.")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make", help="write a procedural task: DIR/train.jsonl and DIR/test.jsonl")
    make.add_argument("task", choices=sorted(TASKS), help="task name")
    make.add_argument("--n", type=int, required=True, help="number of training prompts")
    make.add_argument("--out", type=Path, required=True, help="output folder")
    make.add_argument("--n-test", type=int, default=200, help="number of held-out prompts (default: 200)")
    make.add_argument("--seed", type=int, default=0, help="generator seed (default: 0)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        train, test = make_splits(args.task, args.n, args.n_test, args.seed)
    except DataError as e:
        print(f"verst data make: {e}", file=sys.stderr)
        return 2
    for name, problems in (("train", train), ("test", test)):
        path = write_jsonl(problems, args.out / f"{name}.jsonl")
        print(f"{path}: {len(problems)} {args.task} prompts")
    return 0
