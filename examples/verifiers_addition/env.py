"""A verifiers environment, written with verifiers' own API, trained by verst through the verifiers
connector: two-digit sums; a wrong answer gets the environment's "try again" and one more turn.

    [rollout]
    rollout_fn = "examples.verifiers_addition.env:rollout"

Any installed verifiers environment plugs in the same way: `VerifiersRollout(lambda: vf.load_environment(name))`.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

from verst.connectors.verifiers import VerifiersRollout
from verst.data import make_splits
from verst.rewards.builtin import last_number

RETRY = "Not quite. Try again; reply with only the number."


def answer_of(completion: vf.Messages) -> str | None:
    """The last assistant message's text."""
    return vf.Parser().parse_answer(completion)


def correct(completion: vf.Messages, answer: str, **kwargs) -> float:
    """1.0 when the last number of the final answer is the sum."""
    number = last_number(answer_of(completion) or "")
    return float(number is not None and number == last_number(answer))


class AdditionWithRetry(vf.MultiTurnEnv):
    """Up to two model turns: the first answer, and after a wrong one the environment's retry request."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=2, **kwargs)

    @vf.stop
    async def answered_right(self, state: vf.State) -> bool:
        return bool(state["trajectory"]) and correct(state["trajectory"][-1]["completion"], state["answer"]) == 1.0

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        return [vf.UserMessage(content=RETRY)]


def load_environment(n_train: int = 2000, seed: int = 0) -> AdditionWithRetry:
    """The environment over verst's addition task ('12+34=' -> '46'), `n_train` problems."""
    train, _ = make_splits("addition", n_train=n_train, n_test=100, seed=seed)
    dataset = Dataset.from_list([{"question": p.text, "answer": p.label} for p in train])
    return AdditionWithRetry(dataset=dataset, rubric=vf.Rubric(funcs=[correct]))


# built on first use, in the process that runs the rollouts
rollout = VerifiersRollout(load_environment)
