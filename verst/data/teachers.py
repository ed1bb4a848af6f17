"""Imperfect demonstrators: SFT data written by a teacher with a systematic habit, for showing what RL
with a verifiable reward corrects that imitation learned (the demo's warm start).
"""

from __future__ import annotations

import dataclasses
import random

from verst.data.loading import DataError
from verst.data.tasks import Problem


def forgets_carry(problems: list[Problem], rate: float, seed: int = 0) -> list[Problem]:
    """Addition demonstrations from a teacher who drops the units carry in `rate` of the problems that
    have one ('18+18=' -> '26' instead of '36'); other problems keep their correct label.

    A model imitating this teacher learns both the right sum and the slip, and its greedy answer follows
    the slip wherever `rate` > 0.5; an exact-match reward tells the two apart. Prompts and their order are
    unchanged; each altered row's metadata records `teacher_error`.
    """
    if not 0.0 <= rate <= 1.0:
        raise DataError(f"forgets_carry: rate must be in [0, 1], got {rate}")
    rng = random.Random(f"verst.teachers/forgets_carry/{seed}")
    out = []
    for problem in problems:
        a, b = _operands(problem)
        if (a % 10 + b % 10) >= 10 and rng.random() < rate:
            problem = dataclasses.replace(
                problem, label=str(a + b - 10), metadata={**problem.metadata, "teacher_error": "dropped carry"}
            )
        out.append(problem)
    return out


def _operands(problem: Problem) -> tuple[int, int]:
    if problem.metadata.get("task") != "addition":
        raise DataError(f"forgets_carry needs addition problems, got task {problem.metadata.get('task')!r} "
                        f"for prompt {problem.text!r}")
    left, _, right = problem.text.rstrip("=").partition("+")
    try:
        return int(left), int(right)
    except ValueError:
        raise DataError(f"forgets_carry: prompt {problem.text!r} is not 'A+B='") from None
