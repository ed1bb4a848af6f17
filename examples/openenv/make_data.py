"""Write the OpenEnv example's tasks: `python -m examples.openenv.make_data --out artifacts/data/openenv`.

Each row is an instruction and the environment's reset arguments (`{"seed": n}`: the problem is drawn by
the environment, so the row carries no label).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INSTRUCTION = "Solve the problem. Reply with the number only."


def make_data(out: Path, n_train: int = 512, n_test: int = 64) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, seeds in (("train", range(n_test, n_test + n_train)), ("test", range(n_test))):
        paths[split] = out / f"{split}.jsonl"
        with open(paths[split], "w", encoding="utf-8") as f:
            for seed in seeds:
                f.write(json.dumps({"prompt": INSTRUCTION, "label": "", "metadata": {"openenv_reset": {"seed": seed}}})
                        + "\n")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/data/openenv"))
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-test", type=int, default=64)
    args = parser.parse_args()
    for name, path in make_data(args.out, args.n_train, args.n_test).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
