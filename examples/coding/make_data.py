"""Write the coding environment's data: `python -m examples.coding.make_data --out artifacts/data/coding`.

train.jsonl and test.jsonl hold one row per task of the train and held-out splits
(`verst.sandbox.coding_tasks.generate`): the prompt is the task's with the workspace's file listing, the
metadata carries the task's files (where `sandbox.files_key` finds them), which of them are tests, the tools'
schemas, and (`conversation`, the SFT target of recipes/sft_coding.toml), made in sandboxes of `--provider`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from examples.coding.teacher import teach
from examples.coding.tools import RUN_TESTS, TOOLS
from verst.data import write_jsonl
from verst.data.calculator import CONVERSATION_KEY
from verst.data.tasks import Problem
from verst.sandbox import provider
from verst.sandbox.coding_tasks import CodingTask, generate

N_TRAIN, N_TEST = 240, 40


def task_prompt(task: CodingTask) -> str:
    return (f"{task.prompt}\nFiles in the workspace: {', '.join(sorted(task.files))}.\n"
            f"Run the tests with `{RUN_TESTS}`.")


def task_problem(task: CodingTask, conversation: list[dict[str, Any]] | None) -> Problem:
    """One data row: the label is the task's name (the reward reads the tests, not a label)."""
    metadata: dict[str, Any] = {"task": "coding", "name": task.name, "kind": task.kind, "files": task.files,
                                "test_files": sorted(set(task.files) - set(task.solution)), "tools": TOOLS,
                                "checks": [check.to_dict() for check in task.checks]}
    if conversation is not None:
        metadata[CONVERSATION_KEY] = conversation
    return Problem(task_prompt(task), task.name, metadata)


def split_problems(split: str, count: int, seed: int = 0, provider_name: str = "local",
                   with_teacher: bool = True) -> list[Problem]:
    sandboxes = provider(provider_name) if with_teacher else None
    return [task_problem(task, teach(task, sandboxes) if sandboxes else None) for task in generate(split, count, seed)]


def make_data(out: Path, n_train: int = N_TRAIN, n_test: int = N_TEST, seed: int = 0,
              provider_name: str = "local") -> dict[str, Path]:
    return {
        "train": write_jsonl(split_problems("train", n_train, seed, provider_name), out / "train.jsonl"),
        "test": write_jsonl(split_problems("heldout", n_test, seed, provider_name), out / "test.jsonl"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/data/coding"))
    parser.add_argument("--n-train", type=int, default=N_TRAIN)
    parser.add_argument("--n-test", type=int, default=N_TEST)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--provider", default="local", help="the teacher's sandbox provider (a sandbox.provider name)")
    args = parser.parse_args()
    for name, path in make_data(args.out, args.n_train, args.n_test, args.seed, args.provider).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
