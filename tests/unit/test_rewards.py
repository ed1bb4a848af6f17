"""Built-in rewards, the reward factory (built-in, custom by import path) and compute_rewards."""

from __future__ import annotations

import asyncio
import math

import pytest

from verst.config import ConfigError, ImportPathError, RewardConfig
from verst.rewards import (
    REWARD_ERROR_KEY,
    REWARDS,
    RewardError,
    build_reward_fn,
    compute_rewards,
    exact_match,
    math_verify,
    numeric_match,
    token_f1,
)
from verst.types import Sample, Status


def score(fn, response: str, label) -> float:
    return asyncio.run(fn(Sample(response=response, label=label)))


# Reward fns loaded by import path in the tests below.
async def length_reward(sample: Sample) -> dict[str, float]:
    return {"length": float(len(sample.response)), "correct": float(sample.response == sample.label)}


async def rank_in_group(samples: list[Sample]) -> list[float]:
    """A group reward: 1.0 for the shortest response(s) of the group, else 0.0."""
    shortest = min(len(s.response) for s in samples)
    return [float(len(s.response) == shortest) for s in samples]


def not_async(sample: Sample) -> float:
    return 1.0


# ---- built-ins ---------------------------------------------------------------------------


def test_registry_names():
    assert set(REWARDS) == {"exact_match", "numeric_match", "math_verify", "token_f1", "shape_alignment",
                            "jpeg_compressibility"}


def test_exact_match():
    assert score(exact_match, "  Paris\n", "Paris") == 1.0
    assert score(exact_match, "paris", "Paris") == 0.0
    assert score(exact_match, "46", 46) == 1.0  # a numeric label compares as its text
    assert score(exact_match, "b", ["a", "b"]) == 1.0  # several acceptable answers
    assert score(exact_match, "", "x") == 0.0
    with pytest.raises(RewardError, match="label is None"):
        score(exact_match, "x", None)
    with pytest.raises(RewardError, match="label is an empty list"):
        score(exact_match, "x", [])


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("46", "46", 1.0),
        ("The answer is 46.", "46", 1.0),
        ("46.0", "46", 1.0),
        ("46", 46.0, 1.0),
        ("first 12, finally 46", "46", 1.0),
        ("46, no wait, 45", "46", 0.0),
        ("it is -3", "-3", 1.0),
        ("5-3", "-3", 0.0),  # a minus after a digit is subtraction: the last number is 3
        ("5-3", "3", 1.0),
        ("total 1,234 apples", "1234", 1.0),
        ("0.5", ".5", 1.0),
        ("no digits here", "4", 0.0),
        ("", "0", 0.0),
        ("x=17", ["16", "17"], 1.0),
    ],
)
def test_numeric_match(response, label, expected):
    assert score(numeric_match, response, label) == expected


def test_numeric_match_needs_a_numeric_label():
    with pytest.raises(RewardError, match="label 'forty' is not a number"):
        score(numeric_match, "40", "forty")


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("so the answer is \\boxed{46}", "46", 1.0),
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("$1+x^2$", "x^2+1", 1.0),  # a bare symbolic label is parsed as math
        ("\\boxed{45}", "46", 0.0),
        ("", "46", 0.0),
    ],
)
def test_math_verify(response, label, expected):
    assert score(math_verify, response, label) == expected


def test_math_verify_unparseable_label_and_worker_thread():
    with pytest.raises(RewardError, match="math-verify cannot parse label ' '"):
        score(math_verify, "1", " ")
    # signal-based timeouts only work on the main thread; scoring elsewhere must still work
    result = asyncio.run(asyncio.to_thread(score, math_verify, "\\boxed{3}", "3"))
    assert result == 1.0


def test_token_f1():
    assert score(token_f1, "The Eiffel Tower!", "eiffel tower") == 1.0  # case, punctuation, articles
    assert score(token_f1, "cat sat", "the cat sat down") == pytest.approx(0.8)  # P=1, R=2/3
    assert score(token_f1, "dog", "cat") == 0.0
    assert score(token_f1, "a the", "an") == 1.0  # both empty after normalisation
    assert score(token_f1, "", "cat") == 0.0
    assert score(token_f1, "blue car", ["red car", "blue car"]) == 1.0


# ---- the factory -------------------------------------------------------------------------


def test_build_custom_with_a_bad_import_path():
    with pytest.raises(ImportPathError, match="reward.path = 'tests.unit.test_rewards:missing'.*no attribute 'missing'"):
        build_reward_fn(RewardConfig(type="custom", path="tests.unit.test_rewards:missing"))


def test_build_builtin_and_custom_by_import_path():
    assert build_reward_fn(RewardConfig(type="exact_match")) is exact_match
    fn = build_reward_fn(RewardConfig(type="custom", path="tests.unit.test_rewards:length_reward"))
    assert fn is length_reward
    assert build_reward_fn(RewardConfig(type="custom", path="tests.unit.test_rewards.rank_in_group", group=True)) is rank_in_group


@pytest.mark.parametrize(
    "cfg, message",
    [
        (dict(type="custom"), "needs reward.path"),
        (dict(type="custom", path="tests.unit.test_rewards:not_async"), "is not an async function"),
        (dict(type="exact_match", path="x.y:z"), "reward.path = 'x.y:z' is set but reward.type = 'exact_match'"),
        (dict(type="token_f1", url="http://127.0.0.1:1"), "reward.url = 'http://127.0.0.1:1' is set"),
        (dict(type="remote"), "needs reward.url"),
        (dict(type="remote", url="http://127.0.0.1:1", group=True), "scores one sample"),
        (dict(type="numeric_match", group=True), "needs a custom group fn"),
    ],
)
def test_build_errors_name_the_field(cfg, message):
    with pytest.raises(ConfigError, match=message):
        build_reward_fn(RewardConfig(**cfg))


# ---- compute_rewards ---------------------------------------------------------------------


def test_compute_rewards_fills_every_sample_and_records_failures():
    samples = [
        Sample(index=0, response="46", label="46", status=Status.COMPLETED),
        Sample(index=1, response="45", label="46", status=Status.COMPLETED),
        Sample(index=2, response="7", label=None, status=Status.TRUNCATED),
    ]
    metrics = asyncio.run(compute_rewards(samples, RewardConfig(type="numeric_match")))
    assert [s.reward for s in samples] == [1.0, 0.0, None]
    assert [s.status for s in samples] == [Status.COMPLETED, Status.COMPLETED, Status.FAILED]
    assert samples[2].metadata[REWARD_ERROR_KEY] == "sample 2: label is None; this reward needs a reference answer"
    assert metrics["rollout/reward_failures"] == 1.0
    assert metrics["rollout/reward_mean"] == 0.5
    assert metrics["time/reward_s"] >= 0.0


def test_compute_rewards_dict_rewards_need_a_key():
    cfg = RewardConfig(type="custom", path="tests.unit.test_rewards:length_reward", key="correct")
    samples = [Sample(index=i, response=r, label="ab") for i, r in enumerate(["ab", "abcd"])]
    metrics = asyncio.run(compute_rewards(samples, cfg))
    assert samples[0].reward == {"length": 2.0, "correct": 1.0}
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/reward/length"] == 3.0
    # without a key the dict cannot become a scalar: each sample fails, with the keys in the reason
    samples = [Sample(index=5, response="ab", label="ab")]
    metrics = asyncio.run(compute_rewards(samples, length_reward))
    assert samples[0].status == Status.FAILED and metrics["rollout/reward_failures"] == 1.0
    assert "keys ['correct', 'length']; reward.key = None selects none" in samples[0].metadata[REWARD_ERROR_KEY]


def test_compute_rewards_group_fn_by_config():
    cfg = RewardConfig(type="custom", path="tests.unit.test_rewards:rank_in_group", group=True)
    responses = {0: ["a", "abc", "ab"], 1: ["xyz", "xy", "x"]}
    # samples of two groups, interleaved: the fn must still see each group whole
    samples = [Sample(group_index=g, index=3 * g + i, response=responses[g][i]) for i in range(3) for g in (0, 1)]
    asyncio.run(compute_rewards(samples, cfg))
    rewards = {(s.group_index, s.response): s.reward for s in samples}
    assert rewards == {(0, "a"): 1.0, (0, "abc"): 0.0, (0, "ab"): 0.0, (1, "xyz"): 0.0, (1, "xy"): 0.0, (1, "x"): 1.0}


def test_compute_rewards_group_failures_fail_the_whole_group():
    async def wrong_length(samples):
        return [1.0]

    async def refuses(samples):
        raise RewardError("judge unavailable")

    group = [Sample(group_index=4, index=i) for i in range(2)]
    metrics = asyncio.run(compute_rewards(group, wrong_length, group=True))
    assert metrics["rollout/reward_failures"] == 2.0 and "rollout/reward_mean" not in metrics
    assert "returned list of length 1 for a group of 2 samples" in group[0].metadata[REWARD_ERROR_KEY]
    group = [Sample(group_index=4, index=i) for i in range(2)]
    asyncio.run(compute_rewards(group, refuses, group=True))
    assert all(s.metadata[REWARD_ERROR_KEY] == "group 4: judge unavailable" for s in group)


@pytest.mark.parametrize("value, reason", [(math.nan, "must be finite"), ("1.0", "must be a number"), ({}, "empty dict")])
def test_compute_rewards_rejects_invalid_values(value, reason):
    async def bad(sample):
        return value

    samples = [Sample(index=9)]
    asyncio.run(compute_rewards(samples, bad))
    assert samples[0].reward is None and reason in samples[0].metadata[REWARD_ERROR_KEY]


def test_compute_rewards_lets_bugs_propagate():
    async def buggy(sample):
        raise ZeroDivisionError("bug in the reward fn")

    with pytest.raises(ZeroDivisionError):
        asyncio.run(compute_rewards([Sample()], buggy))
    with pytest.raises(TypeError, match="pass group/key through the RewardConfig"):
        asyncio.run(compute_rewards([Sample()], RewardConfig(), key="x"))


def test_an_unregistered_reward_is_refused_naming_the_registered_ones():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"reward.type = 'bleu' is not registered; registered: exact_match, "
                                              r"numeric_match, math_verify, token_f1.*'remote' .*'custom'"):
        RewardConfig(type="bleu")
