"""Write the calculator task's data: `python -m examples.calculator.make_data --out artifacts/data/calculator`.

train.jsonl and test.jsonl hold the gold conversations and true labels; sft_teacher.jsonl holds the
train prompts as demonstrated by a teacher who does a last addition in their head
(`verst.data.teachers.mental_last_step`), the SFT warm start of recipes/sft_calculator.toml.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from verst.data import make_splits, write_jsonl
from verst.data.teachers import mental_last_step

N_TRAIN, N_TEST = 3384, 200  # every distinct prompt of the task is in one split or the other
TEACHER_RATE = 0.75  # in 3 of 4 problems that end with an addition, the teacher adds in their head


def make_data(out: Path, n_train: int = N_TRAIN, n_test: int = N_TEST, rate: float = TEACHER_RATE,
              seed: int = 0) -> dict[str, Path]:
    train, test = make_splits("calculator", n_train, n_test, seed)
    return {
        "train": write_jsonl(train, out / "train.jsonl"),
        "test": write_jsonl(test, out / "test.jsonl"),
        "sft_teacher": write_jsonl(mental_last_step(train, rate, ops="+", seed=seed), out / "sft_teacher.jsonl"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/data/calculator"))
    parser.add_argument("--n-train", type=int, default=N_TRAIN)
    parser.add_argument("--n-test", type=int, default=N_TEST)
    parser.add_argument("--teacher-rate", type=float, default=TEACHER_RATE)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, path in make_data(args.out, args.n_train, args.n_test, args.teacher_rate, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
