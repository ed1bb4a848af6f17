"""The imperfect teacher behind the demo's SFT data: which labels it changes, how, and its refusals."""

import dataclasses

import pytest

from verst.data import DataError, make_splits
from verst.data.tasks import Problem
from verst.data.teachers import forgets_carry


def has_carry(problem):
    a, b = map(int, problem.text.rstrip("=").split("+"))
    return (a % 10 + b % 10) >= 10


def test_only_carry_problems_change_and_they_lose_exactly_the_carry():
    train, _ = make_splits("addition", n_train=2000, n_test=10, seed=0)
    taught = forgets_carry(train, rate=0.7, seed=0)
    assert [p.text for p in taught] == [p.text for p in train]  # same prompts, same order
    changed = [(t, p) for t, p in zip(taught, train) if t.label != p.label]
    assert all(has_carry(p) and int(t.label) == int(p.label) - 10 for t, p in changed)
    assert all(t.metadata["teacher_error"] == "dropped carry" for t, _ in changed)
    carries = sum(map(has_carry, train))
    assert 0.65 < len(changed) / carries < 0.75  # the rate, up to sampling noise over ~900 problems
    assert all("teacher_error" not in p.metadata for p in train)  # the inputs are not modified


def test_in_a_chain_each_running_sum_may_drop_its_carry_and_the_next_builds_on_it():
    chain = [Problem("18+18+2+11=", "36,38,49", {"task": "chain_addition"})]
    assert forgets_carry(chain, 0.0) == chain
    always = forgets_carry(chain, 1.0)[0]
    # 18+18 drops its carry (26); 26+2 and 28+11 have none
    assert (always.label, always.metadata["teacher_error"]) == ("26,28,39", "dropped 1 carry")
    twice = forgets_carry([Problem("19+19+19=", "38,57", {"task": "chain_addition"})], 1.0)[0]
    assert (twice.label, twice.metadata["teacher_error"]) == ("28,37", "dropped 2 carries")  # 28+19 carries too


def test_on_two_terms_chain_addition_is_the_addition_teacher():
    train, _ = make_splits("addition", n_train=300, n_test=10, seed=1)
    as_chains = [dataclasses.replace(p, metadata={"task": "chain_addition"}) for p in train]
    assert [p.label for p in forgets_carry(as_chains, 0.7)] == [p.label for p in forgets_carry(train, 0.7)]


def test_rate_bounds_and_determinism():
    train, _ = make_splits("addition", n_train=300, n_test=10, seed=1)
    assert forgets_carry(train, 0.0) == train
    assert all(int(p.label) == int(q.label) - 10 for p, q in zip(forgets_carry(train, 1.0), train) if has_carry(q))
    assert forgets_carry(train, 0.5, seed=3) == forgets_carry(train, 0.5, seed=3)
    with pytest.raises(DataError, match="rate must be in \\[0, 1\\], got 1.5"):
        forgets_carry(train, 1.5)


def test_refuses_problems_that_are_not_addition():
    with pytest.raises(DataError, match="needs addition problems, got task 'reversal'"):
        forgets_carry([Problem("reverse abc=", "cba", {"task": "reversal"})], 0.5)
    with pytest.raises(DataError, match="'1\\*2=' is not 'A\\+B=' or 'A\\+B\\+...='"):
        forgets_carry([Problem("1*2=", "2", {"task": "addition"})], 0.5)
    with pytest.raises(DataError, match="'12=' has fewer than two terms"):
        forgets_carry([Problem("12=", "12", {"task": "chain_addition"})], 0.5)
