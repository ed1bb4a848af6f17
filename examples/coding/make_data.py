"""Write the coding environment's data: `python -m examples.coding.make_data --out artifacts/data/coding`.

train.jsonl and test.jsonl hold one row per task of the train and held-out splits
(`verst.sandbox.coding_tasks.generate`): the prompt is the task's with the workspace's file listing, the
metadata carries the task's files (where `sandbox.files_key` finds them), which of them are tests, the tools'
schemas, and (`conversation`, the SFT target of recipes/sft_coding.toml), made in sandboxes of `--provider`.

`--shortcut P` makes the teacher write the fix without reading first in a fraction P of the train tasks, as an
expert who knows the code would; `--familiar NAMES` limits that habit to the tasks on those functions (the ones
the teacher knows). `make demo-coding`'s data: `--family operators --tools shell,edit_file --n-train 2400
--shortcut 0.75 --familiar blend,combine,merge,mix`.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from examples.coding.teacher import teach
from examples.coding.tools import RUN_TESTS, TOOL_NAMES, TOOLS
from verst.data import write_jsonl
from verst.data.calculator import CONVERSATION_KEY
from verst.data.tasks import Problem
from verst.sandbox import provider
from verst.sandbox.coding_tasks import FAMILIES, FAMILY_FUNCTIONS, CodingTask, generate

N_TRAIN, N_TEST = 240, 40
TEACHERS = 4  # tasks solved at once


def task_prompt(task: CodingTask) -> str:
    return (f"{task.prompt}\nFiles in the workspace: {', '.join(sorted(task.files))}.\n"
            f"Run the tests with `{RUN_TESTS}`.")


def task_problem(task: CodingTask, conversation: list[dict[str, Any]] | None,
                 tools: Sequence[str] = TOOL_NAMES) -> Problem:
    """One data row: the label is the task's name (the reward reads the tests, not a label)."""
    schemas = [tool for tool in TOOLS if tool["function"]["name"] in tools]
    metadata: dict[str, Any] = {"task": "coding", "name": task.name, "kind": task.kind, "files": task.files,
                                "test_files": sorted(set(task.files) - set(task.solution)), "tools": schemas,
                                "checks": [check.to_dict() for check in task.checks]}
    if conversation is not None:
        metadata[CONVERSATION_KEY] = conversation
    return Problem(task_prompt(task), task.name, metadata)


def split_problems(split: str, count: int, seed: int = 0, provider_name: str = "local", with_teacher: bool = True,
                   family: str = "operations", tools: Sequence[str] = TOOL_NAMES, shortcut: float = 0.0,
                   familiar: Sequence[str] = ()) -> list[Problem]:
    """The rows of a split; with the teacher, each row's transcript takes the shortcut (no reads) with probability
    `shortcut` (seeded), on every task or, with `familiar`, on the tasks on those functions only."""
    unknown = sorted(set(tools) - set(TOOL_NAMES))
    if unknown or "shell" not in tools or "edit_file" not in tools:
        raise ValueError(f"tools {list(tools)}: choose from {', '.join(TOOL_NAMES)}, with shell and edit_file")
    if not 0.0 <= shortcut <= 1.0:
        raise ValueError(f"shortcut {shortcut}: a fraction of the tasks, from 0 to 1")
    sandboxes = provider(provider_name) if with_teacher else None
    tasks = generate(split, count, seed, family)
    unknown = sorted(set(familiar) - set(FAMILY_FUNCTIONS[family]))
    if unknown:
        raise ValueError(f"familiar {list(familiar)}: {unknown} name no function of the {family!r} tasks "
                         f"({', '.join(FAMILY_FUNCTIONS[family])})")
    if sandboxes is None:
        return [task_problem(task, None, tools) for task in tasks]
    rng = random.Random(f"familiar:{seed}" if familiar else f"shortcut:{seed}")  # a draw per task it may take
    habits = [(not familiar or task.function in familiar) and rng.random() < shortcut for task in tasks]
    with ThreadPoolExecutor(TEACHERS) as pool:  # each transcript waits on its sandbox's processes
        transcripts = pool.map(lambda job: teach(job[0], sandboxes, tools, job[1]), zip(tasks, habits))
        return [task_problem(task, transcript, tools) for task, transcript in zip(tasks, transcripts)]


def make_data(out: Path, n_train: int = N_TRAIN, n_test: int = N_TEST, seed: int = 0, provider_name: str = "local",
              family: str = "operations", tools: Sequence[str] = TOOL_NAMES, shortcut: float = 0.0,
              familiar: Sequence[str] = ()) -> dict[str, Path]:
    """train.jsonl (with the teacher's transcripts) and test.jsonl (held out; transcripts without the shortcut)."""
    return {
        "train": write_jsonl(split_problems("train", n_train, seed, provider_name, True, family, tools, shortcut,
                                            familiar), out / "train.jsonl"),
        "test": write_jsonl(split_problems("heldout", n_test, seed, provider_name, True, family, tools),
                            out / "test.jsonl"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/data/coding"))
    parser.add_argument("--n-train", type=int, default=N_TRAIN)
    parser.add_argument("--n-test", type=int, default=N_TEST)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--provider", default="local", help="the teacher's sandbox provider (a sandbox.provider name)")
    parser.add_argument("--family", default="operations", choices=FAMILIES, help="the task family")
    parser.add_argument("--tools", default=",".join(TOOL_NAMES), help="the episode's tools, comma-separated")
    parser.add_argument("--shortcut", type=float, default=0.0,
                        help="the fraction of train tasks whose transcript writes the fix without reading first")
    parser.add_argument("--familiar", default="",
                        help="comma-separated functions: the shortcut is taken on the tasks on these only")
    args = parser.parse_args()
    for name, path in make_data(args.out, args.n_train, args.n_test, args.seed, args.provider, args.family,
                                args.tools.split(","), args.shortcut,
                                [name for name in args.familiar.split(",") if name]).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
