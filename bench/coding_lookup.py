"""Does a coding model take the fix from the tests it read? For held-out `operators` tasks, the model continues
each task's transcript after its `cat test_project.py` output (sampled at temperature 1.0) and the bench counts
the edits whose operator is the one the tests state; a student that only guesses gets one in four.

    .venv/bin/python bench/coding_lookup.py runs/sft-coding-demo/hf --data artifacts/data/coding_operators/test.jsonl

Prints the count and the ratio to the guessing baseline (1/4). The model and data are `make demo-coding`'s; without
them (`make bench` on a fresh machine) it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

EDIT = re.compile(r"return a (\S+) b")


def right_operator(conversation: list[dict]) -> str:
    """The operator of the teacher's edit (the transcript's second call, after the read)."""
    content = json.loads(conversation[2]["tool_calls"][0]["function"]["arguments"])["content"]
    return EDIT.search(content).group(1)


def main() -> int:
    import torch

    from verst.models import load_model, load_tokenizer
    from verst.sandbox.coding_tasks import OPERATORS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, nargs="?", default=Path("runs/sft-coding-demo/hf"))
    parser.add_argument("--data", type=Path, default=Path("artifacts/data/coding_operators/test.jsonl"))
    parser.add_argument("--tasks", type=int, default=12)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    missing = [str(path) for path in (args.model / "config.json", args.data) if not path.exists()]
    if missing:
        print(f"skipped: {', '.join(missing)} missing; `make demo-coding` makes the model and the data")
        return 0
    tokenizer, model = load_tokenizer(args.model), load_model(args.model).eval()
    rows = [json.loads(line) for line in args.data.read_text().splitlines()][: args.tasks]
    torch.manual_seed(0)
    right = written = 0
    for row in rows:
        conversation = row["metadata"]["conversation"]
        if conversation[0]["tool_calls"][0]["function"]["name"] != "shell":
            raise ValueError(f"{row['label']}: the transcript does not read the tests first")
        ids = tokenizer.apply_chat_template(row["prompt"] + conversation[:2], tools=row["metadata"]["tools"],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(ids["input_ids"].repeat(args.samples, 1), max_new_tokens=160, do_sample=True,
                             temperature=1.0, pad_token_id=tokenizer.pad_token_id)
        edits = [EDIT.search(tokenizer.decode(o[ids["input_ids"].shape[1]:])) for o in out]
        ops = [edit.group(1) for edit in edits if edit]
        written += len(ops)
        right += ops.count(right_operator(conversation))
    total = len(rows) * args.samples
    print(f"right operator after reading the tests: {right}/{total} samples ({written} wrote an edit of the form "
          f"'return a OP b'); guessing among {len(OPERATORS)}: {total / len(OPERATORS):.0f}/{total}; "
          f"ratio to guessing {right / (total / len(OPERATORS)):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
