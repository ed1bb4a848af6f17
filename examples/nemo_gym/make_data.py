"""Write the NeMo Gym example's tasks: `python -m examples.nemo_gym.make_data --out artifacts/data/nemo_gym`.

Each row is a NeMo Gym task row (`responses_create_params` with the `add` tool, and the `expected` sum the
resources server verifies) under `metadata.nemo_gym_row`; the prompt is the row's input, for verst.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# The tool's schema, as examples/nemo_gym/resources.py serves it (that module needs NeMo Gym's environment).
ADD_TOOL = {"type": "function", "name": "add", "description": "Add two integers.", "strict": True,
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"], "additionalProperties": False}}


def row(rng: random.Random) -> dict:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    messages = [{"role": "user", "content": f"What is {a} + {b}? Use the add tool, then answer with the number."}]
    nemo_row = {"responses_create_params": {"input": messages, "tools": [ADD_TOOL]}, "expected": a + b}
    return {"prompt": messages, "label": str(a + b), "metadata": {"nemo_gym_row": nemo_row}}


def make_data(out: Path, n_train: int = 512, n_test: int = 64, seed: int = 0) -> dict[str, Path]:
    rng, paths = random.Random(seed), {}
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("test", n_test), ("train", n_train)):
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(row(rng)) + "\n" for _ in range(n)), encoding="utf-8")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/data/nemo_gym"))
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-test", type=int, default=64)
    args = parser.parse_args()
    for name, path in make_data(args.out, args.n_train, args.n_test).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
