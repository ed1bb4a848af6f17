"""Imperfect demonstrators: SFT data written by a teacher with a systematic habit, for showing what RL
with a verifiable reward corrects that imitation learned (the demos' warm starts: addition, the calculator).
"""

from __future__ import annotations

import dataclasses
import random

from verst.data.calculator import CONVERSATION_KEY, OPERATIONS, call_expression, parse_expression
from verst.data.loading import DataError
from verst.data.tasks import Problem


def forgets_carry(problems: list[Problem], rate: float, seed: int = 0) -> list[Problem]:
    """Addition demonstrations from a teacher who drops the units carry in `rate` of the additions that
    have one ('18+18=' -> '26' instead of '36'); other problems keep their correct label. In a chain
    ('18+18+5=' -> '36,41') each running sum is one addition, taken from the teacher's own previous sum.

    A model imitating this teacher learns both the right sum and the slip, and its greedy answer follows
    the slip wherever `rate` > 0.5; an exact-match reward tells the two apart. Prompts and their order are
    unchanged; each altered row's metadata records `teacher_error`.
    """
    if not 0.0 <= rate <= 1.0:
        raise DataError(f"forgets_carry: rate must be in [0, 1], got {rate}")
    rng = random.Random(f"verst.teachers/forgets_carry/{seed}")
    out = []
    for problem in problems:
        terms = _operands(problem)
        total, sums, dropped = terms[0], [], 0
        for term in terms[1:]:
            carry = (total % 10 + term % 10) >= 10
            slip = carry and rng.random() < rate
            total += term - (10 if slip else 0)
            dropped += slip
            sums.append(str(total))
        if dropped:
            noun = "carry" if dropped == 1 else "carries"
            error = "dropped carry" if len(terms) == 2 else f"dropped {dropped} {noun}"
            problem = dataclasses.replace(
                problem, label=",".join(sums), metadata={**problem.metadata, "teacher_error": error}
            )
        out.append(problem)
    return out


def _operands(problem: Problem) -> list[int]:
    if problem.metadata.get("task") not in ("addition", "chain_addition"):
        raise DataError(f"forgets_carry needs addition problems, got task {problem.metadata.get('task')!r} "
                        f"for prompt {problem.text!r}")
    try:
        terms = [int(t) for t in problem.text.rstrip("=").split("+")]
    except ValueError:
        raise DataError(f"forgets_carry: prompt {problem.text!r} is not 'A+B=' or 'A+B+...='") from None
    if len(terms) < 2:
        raise DataError(f"forgets_carry: prompt {problem.text!r} has fewer than two terms")
    return terms


def mental_last_step(problems: list[Problem], rate: float, ops: str = "+", seed: int = 0) -> list[Problem]:
    """Demonstrations from a teacher who does an easy last step in their head: in `rate` of the problems
    whose last operation is one of `ops`, the conversation answers as soon as the calculator has left
    that one operation ('21+5'), without the last call. Every answer stays correct.

    A student that cannot add in its head, imitating this teacher, skips the call it needs there once
    `rate` > 0.5; an outcome reward shows that calling the tool pays. Altered rows record
    `metadata['teacher'] = 'mental last step'`; prompts and their order are unchanged.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"mental_last_step: rate must be in [0, 1], got {rate}")
    if not ops or set(ops) - set(OPERATIONS):
        raise ValueError(f"mental_last_step: ops = {ops!r} must be a non-empty string of {sorted(OPERATIONS)}")
    rng = random.Random(f"verst.calculator/mental_last_step/{seed}")
    out = []
    for problem in problems:
        conversation = problem.metadata.get(CONVERSATION_KEY)
        if not conversation or problem.metadata.get("task") != "calculator":
            raise ValueError(f"mental_last_step needs calculator problems with a gold conversation, got task "
                             f"{problem.metadata.get('task')!r} for prompt {problem.text!r}")
        calls = [m for m in conversation if m.get("tool_calls")]
        last_op = parse_expression(call_expression(calls[-1]))[1][0]
        if len(calls) > 1 and last_op in ops and rng.random() < rate:
            hasty = conversation[:-3] + [conversation[-1]]  # drop the last call and its result
            metadata = {**problem.metadata, CONVERSATION_KEY: hasty, "teacher": "mental last step"}
            problem = dataclasses.replace(problem, metadata=metadata)
        out.append(problem)
    return out
