"""What a coding model does on held-out `operators` tasks, split between the functions the teacher knew (it wrote
their fix without reading the tests in most of its transcripts, `make_data --familiar`) and the rest: how often
its first move reads the tests (greedy, and in samples at temperature 1.0), and, given the transcript up to the
output of `cat test_project.py`, how often its greedy edit writes the operator the tests state (a guess among the
four operators gets one in four).

    .venv/bin/python bench/coding_lookup.py runs/sft-coding-demo/hf [runs/grpo-coding-demo/hf ...]

Prints a line per model and group. The models and data are `make demo-coding`'s; without them (`make bench` on a
fresh machine) it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EDIT = re.compile(r"return a (\S+) b")
READ_CALLS = ('"cat test_project.py"', '"path": "test_project.py"')  # shell's read, read_file's


def right_operator(conversation: list[dict]) -> str:
    """The operator of the teacher's edit (the transcript's second call, after the read)."""
    content = json.loads(conversation[2]["tool_calls"][0]["function"]["arguments"])["content"]
    return EDIT.search(content).group(1)


def measure(model_dir: Path, rows: list[dict[str, Any]], familiar: set[str], samples: int) -> dict[str, Counter]:
    import torch

    from verst.models import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir).eval()

    def replies(messages: list[dict], tools: list[dict], n: int = 1) -> list[str]:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": None, "top_p": None} if n > 1 else \
            {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        with torch.no_grad():
            out = model.generate(ids.repeat(n, 1), max_new_tokens=160, pad_token_id=tokenizer.pad_token_id,
                                 **sampling)
        return [tokenizer.decode(o[ids.shape[1]:], skip_special_tokens=True) for o in out]

    def reads(reply: str) -> bool:
        return any(call in reply for call in READ_CALLS)

    torch.manual_seed(0)
    counts = {"familiar": Counter(), "other": Counter()}
    for row in rows:
        metadata, conversation = row["metadata"], row["metadata"]["conversation"]
        if not reads(conversation[0]["tool_calls"][0]["function"]["arguments"]):
            raise ValueError(f"{row['label']}: the held-out transcript does not read the tests first")
        group = counts["familiar" if row["label"].split("-")[1] in familiar else "other"]
        group["tasks"] += 1
        group["reads_greedy"] += reads(replies(row["prompt"], metadata["tools"])[0])
        group["reads_sampled"] += sum(map(reads, replies(row["prompt"], metadata["tools"], samples)))
        edit = EDIT.search(replies(row["prompt"] + conversation[:2], metadata["tools"])[0])
        group["right_after_read"] += bool(edit and edit.group(1) == right_operator(conversation))
    return counts


def main() -> int:
    from examples.demo_coding import DATA_DIR, FAMILIAR
    from verst.sandbox.coding_tasks import OPERATORS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="*", default=[Path("runs/sft-coding-demo/hf")])
    parser.add_argument("--data", type=Path, default=DATA_DIR / "test.jsonl")
    parser.add_argument("--familiar", default=",".join(FAMILIAR),
                        help="the functions the teacher knew, comma-separated (make demo-coding's by default)")
    parser.add_argument("--samples", type=int, default=8, help="first moves sampled per task")
    args = parser.parse_args()
    missing = [str(path) for path in [*(m / "config.json" for m in args.models), args.data] if not path.exists()]
    if missing:
        print(f"skipped: {', '.join(missing)} missing; `make demo-coding` makes the models and the data")
        return 0
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    for model_dir in args.models:
        for name, c in measure(model_dir, rows, set(args.familiar.split(",")), args.samples).items():
            n = c["tasks"]
            print(f"{model_dir} {name} functions, {n} tasks: reads the tests first {c['reads_greedy']}/{n} greedy, "
                  f"{c['reads_sampled']}/{n * args.samples} sampled; right operator after reading "
                  f"{c['right_after_read']}/{n} greedy ({c['right_after_read'] / max(n / len(OPERATORS), 1e-9):.2f} "
                  f"times a guess among {len(OPERATORS)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
