"""Procedural verifiable tasks (addition, chain addition, small addition, reversal, multistep, calculator) from seeded generators, and their splits.

Prompts are short and plain (one user message) so a tiny model with a byte tokenizer can learn them;
`small_addition` is worded for a pretrained chat model.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.data.calculator import calculator_problem
from verst.data.loading import DataError


@dataclass(frozen=True)
class Problem:
    """One task instance: the user message text, its answer, and task metadata."""

    text: str
    label: str
    metadata: dict[str, Any]

    def to_row(self) -> dict[str, Any]:
        """The JSONL row in the default DataConfig layout (prompt / label / metadata)."""
        return {"prompt": [{"role": "user", "content": self.text}], "label": self.label, "metadata": self.metadata}


def addition(rng: random.Random) -> Problem:
    """Two 2-digit numbers: '12+34=' -> '46'."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return Problem(f"{a}+{b}=", str(a + b), {"task": "addition"})


def small_addition(rng: random.Random) -> Problem:
    """Two numbers from 1 to 15 asked in words, for a pretrained chat model: 'What is 7 + 12? Reply with
    only the number.' -> '19'. SmolLM2-135M-Instruct knows most of these sums but often buries the answer
    in an equation or a sentence; `make demo-real` rewards the last number it writes."""
    a, b = rng.randint(1, 15), rng.randint(1, 15)
    return Problem(f"What is {a} + {b}? Reply with only the number.", str(a + b), {"task": "small_addition"})


# (% of problems, fewest terms, most terms): most chains are a plain sum, a few are long. Response lengths
# follow (one running sum per extra term), the long tail that RL on reasoning tasks sees.
CHAIN_TERMS = ((80, 2, 2), (15, 3, 5), (5, 8, 12))


def chain_addition(rng: random.Random) -> Problem:
    """A sum of 2-digit numbers answered with its running sums: '12+34+56=' -> '46,102'. Two terms are
    the addition task; the number of terms is long-tailed (CHAIN_TERMS), and so is the answer's length."""
    u, edge = rng.randrange(100), 0
    for share, fewest, most in CHAIN_TERMS:
        edge += share
        if u < edge:
            terms = [rng.randint(10, 99) for _ in range(rng.randint(fewest, most))]
            break
    else:
        raise AssertionError(f"CHAIN_TERMS shares sum to {edge}, not 100")
    return Problem("+".join(map(str, terms)) + "=", running_sums(terms), {"task": "chain_addition"})


def running_sums(terms: list[int]) -> str:
    """'46,102' for [12, 34, 56]: the partial sums after the second term on."""
    sums, total = [], terms[0]
    for term in terms[1:]:
        total += term
        sums.append(str(total))
    return ",".join(sums)


def reversal(rng: random.Random, min_len: int = 3, max_len: int = 6) -> Problem:
    """A short lowercase string: 'reverse abcd=' -> 'dcba'."""
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
    return Problem(f"reverse {word}=", word[::-1], {"task": "reversal", "word": word})


def multistep(rng: random.Random, min_steps: int = 2, max_steps: int = 3) -> Problem:
    """Chained integer arithmetic such as '(12+7)*3-5=' -> '52'; the expression is in metadata."""
    value = rng.randint(2, 20)
    expression, additive = str(value), False
    for _ in range(rng.randint(min_steps, max_steps)):
        op, n = rng.choice("+-*"), rng.randint(2, 20)
        if op == "*":
            # Left-to-right evaluation order: a product of an additive expression needs brackets.
            expression = f"({expression})*{n}" if additive else f"{expression}*{n}"
            value, additive = value * n, False
        else:
            expression = f"{expression}{op}{n}"
            value, additive = (value + n if op == "+" else value - n), True
    return Problem(f"{expression}=", str(value), {"task": "multistep", "expression": expression})


def calculator(rng: random.Random) -> Problem:
    """Chained arithmetic for the calculator tool: '7*3-5=' -> '16', with the tool schema in
    metadata['tools'] and the gold tool-using conversation in metadata['conversation']."""
    return Problem(*calculator_problem(rng))


# name -> (generator, number of distinct prompts it can produce, or None when practically unbounded)
TASKS: dict[str, tuple[Callable[[random.Random], Problem], int | None]] = {
    "addition": (addition, 90 * 90),
    "chain_addition": (chain_addition, None),
    "small_addition": (small_addition, 15 * 15),
    "reversal": (reversal, None),
    "multistep": (multistep, None),
    # operands 2..9 (8 each); operator pairs: '*' then any of 3, or '+'/'-' then '+'/'-' (no brackets)
    "calculator": (calculator, 8**3 * (3 + 2 * 2)),
}


def make_splits(task: str, n_train: int, n_test: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Distinct problems, test first: the test split depends only on (task, n_test, seed).

    Train and test never share a prompt text.
    """
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}; known tasks: {sorted(TASKS)}")
    if n_train < 0 or n_test < 0:
        raise DataError(f"task {task!r}: n_train ({n_train}) and n_test ({n_test}) must be >= 0")
    generate, size = TASKS[task]
    total = n_train + n_test
    if size is not None and total > size:
        raise DataError(f"task {task!r} has {size} distinct prompts; asked for {n_train} train + {n_test} test = {total}")
    rng = random.Random(f"verst.tasks/{task}/{seed}")
    seen: set[str] = set()
    problems: list[Problem] = []
    # Rejection sampling; the bound only catches a generator that cannot produce enough distinct prompts.
    for _ in range(100 * total + 10_000):
        if len(problems) == total:
            break
        problem = generate(rng)
        if problem.text not in seen:
            seen.add(problem.text)
            problems.append(problem)
    if len(problems) < total:
        raise DataError(f"task {task!r}: found only {len(problems)} distinct prompts of the {total} asked for")
    return problems[n_test:], problems[:n_test]


def write_jsonl(problems: list[Problem], path: str | Path) -> Path:
    """Write problems as JSONL rows (creating parent folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps(problem.to_row()) + "\n")
    return path
