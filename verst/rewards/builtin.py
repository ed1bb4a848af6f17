"""Built-in reward fns, each `async (sample) -> float`, registered by name in
`verst.config.registries.REWARDS`.

A wrong answer scores 0.0; a sample that cannot be scored at all (no usable label) raises RewardError.
"""

from __future__ import annotations

import collections
import re
import string
import threading
from decimal import Decimal, InvalidOperation

from verst.rewards.values import RewardError
from verst.types import Sample

# A number, optionally negative (a '-' right after a digit or letter is an operator, not a sign),
# with optional thousands separators and decimals: "-3", "1,234.5", "46".
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PUNCTUATION = frozenset(string.punctuation)


def labels_of(sample: Sample) -> list[str]:
    """The reference answers as strings; a list label means several acceptable answers."""
    label = sample.label
    if label is None:
        raise RewardError(f"sample {sample.index}: label is None; this reward needs a reference answer")
    answers = list(label) if isinstance(label, (list, tuple)) else [label]
    if not answers:
        raise RewardError(f"sample {sample.index}: label is an empty list")
    return [str(a) for a in answers]


async def exact_match(sample: Sample) -> float:
    """1.0 if the stripped response equals a stripped label, else 0.0."""
    response = sample.response.strip()
    return float(any(response == answer.strip() for answer in labels_of(sample)))


def last_number(text: str) -> Decimal | None:
    """The last number written in `text` (exact decimal), or None if there is none."""
    matches = _NUMBER.findall(text)
    return Decimal(matches[-1].replace(",", "")) if matches else None


async def numeric_match(sample: Sample) -> float:
    """1.0 if the last number in the response equals a label numerically ('46.0' == '46'), else 0.0."""
    golds = []
    for answer in labels_of(sample):
        try:
            golds.append(Decimal(answer.strip().replace(",", "")))
        except InvalidOperation:
            raise RewardError(f"sample {sample.index}: label {answer!r} is not a number") from None
    predicted = last_number(sample.response)
    return float(predicted is not None and any(predicted == gold for gold in golds))


async def math_verify(sample: Sample) -> float:
    """1.0 if math-verify finds the response equivalent to a label (LaTeX or plain expressions)."""
    from math_verify import parse, verify  # lazy: sympy takes about a second to import

    # math-verify times out through signal.alarm, which only works on the main thread; elsewhere
    # (Ray actors run async code on other threads) it must run without its timeout.
    timeout: int | None = 5 if threading.current_thread() is threading.main_thread() else None
    predicted = parse(sample.response, parsing_timeout=timeout)
    for answer in labels_of(sample):
        # A bare label like 'x^2+1' is not extracted as-is; the same text inside $...$ is.
        gold = parse(answer, parsing_timeout=timeout) or parse(f"${answer}$", parsing_timeout=timeout)
        if not gold:
            raise RewardError(f"sample {sample.index}: math-verify cannot parse label {answer!r}")
        if predicted and verify(gold, predicted, timeout_seconds=timeout):
            return 1.0
    return 0.0


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles (a, an, the), single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, reference: str) -> float:
    """Token-overlap F1 of two normalised answers; two empty answers match, one empty scores 0."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


async def token_f1(sample: Sample) -> float:
    """SQuAD-style token F1 between the response and the best-matching label."""
    return max(f1_score(sample.response, answer) for answer in labels_of(sample))
