"""Write the Harbor example's tasks: `python -m examples.harbor.make_data --out artifacts/data/harbor`.

Each row names a Harbor task folder (`metadata.harbor_task`); the prompt is the task's instruction, which
the trial itself gives the agent (a row is a task, not a prompt). The example has one task, repeated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TASKS = Path(__file__).with_name("tasks")


def make_data(out: Path, n_train: int = 8, n_test: int = 4) -> dict[str, Path]:
    task = TASKS / "add"
    row = {"prompt": (task / "instruction.md").read_text(encoding="utf-8").strip(), "label": "",
           "metadata": {"harbor_task": str(task)}}
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("test", n_test)):
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text((json.dumps(row) + "\n") * n, encoding="utf-8")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/data/harbor"))
    args = parser.parse_args()
    for name, path in make_data(args.out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
