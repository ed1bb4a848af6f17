"""Every example of docs/plugins.md (examples/plugins/) runs through its plug-in contract, loaded by the
import path the docs give, so the documented examples keep working."""

import asyncio

import pytest

from tests.contracts.test_agent_fn_contract import make_sample, run_episode
from verst.config import DataConfig, RewardConfig, RolloutConfig, load_object
from verst.rewards import compute_rewards
from verst.rollout.filters import apply_filter, build_filter
from verst.rollout.plugins import RolloutContext
from verst.rollout.rollout_fn import run_rollout
from verst.types import Sample, Status


def source():
    return load_object("examples.plugins.data_source:times_tables", "data.source")(DataConfig(seed=3))


def test_data_source_serves_numbered_groups_and_takes_prompts_back():
    src = source()
    groups = src.next_groups(2, 4)
    assert [len(g) for g in groups] == [4, 4] and [g[0].group_index for g in groups] == [0, 1]
    a, b = groups[0][0].prompt[:-1].split("*")
    assert groups[0][0].label == str(int(a) * int(b))
    src.return_prompts(groups[1])
    assert src.next_prompts(1)[0].prompt == groups[1][0].prompt  # returned prompts come first
    assert source().next_prompts(5)[0].prompt == source().next_prompts(5)[0].prompt  # seeded order


def test_dict_reward_and_group_reward():
    samples = [Sample(index=i, label="56", response=r) for i, r in enumerate(["56", "it is 56", "55"])]
    metrics = asyncio.run(compute_rewards(samples, RewardConfig(
        type="custom", path="examples.plugins.reward:correct_and_short", key="correct")))
    assert [s.reward["correct"] for s in samples] == [1.0, 1.0, 0.0]
    assert metrics["rollout/reward_mean"] == pytest.approx(2 / 3) and "rollout/reward/short" in metrics
    asyncio.run(compute_rewards(samples, RewardConfig(
        type="custom", path="examples.plugins.reward:first_correct_in_group", group=True)))
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0]


def test_oracle_generate_fn_and_one_round_rollout_fn_score_every_sample(tok):
    rollout = RolloutConfig(batch_size=2, n_samples_per_prompt=3, generate_fn="examples.plugins.generate:oracle",
                            rollout_fn="examples.plugins.rollout:one_round")
    ctx = RolloutContext(engine=object(), tokenizer=tok, rollout=rollout, data=DataConfig(apply_chat_template=False),
                         reward=RewardConfig(type="numeric_match"), source=source())
    batch = asyncio.run(run_rollout(ctx, 2))  # run_rollout also checks the batch's shape
    assert [len(g) for g in batch.groups] == [3, 3]
    assert all(s.reward == 1.0 and s.status is Status.COMPLETED for s in batch.samples)
    s = batch.samples[0]
    assert tok.decode(s.tokens) == s.prompt + s.label and s.loss_mask == [1] * s.response_length
    assert batch.metrics["rollout/reward_mean"] == 1.0


def test_filter_drops_groups_with_a_truncated_sample():
    keep = build_filter("examples.plugins.filters:no_truncated")
    done, cut = Sample(status=Status.COMPLETED), Sample(status=Status.TRUNCATED)
    assert apply_filter(keep, [done, done]) is True and apply_filter(keep, [done, cut]) is False


def test_one_turn_agent_through_the_session_server(tok):
    result, engine = run_episode(tok, "examples.plugins.agent:ask_once", make_sample())
    assert result.status is Status.COMPLETED and result.metadata["agent_turns"] == 1
    assert len(engine.calls) == 1 and result.tokens == engine.calls[0].input_ids + engine.calls[0].output_ids
    assert result.loss_mask == [1] * result.response_length


def test_docs_show_the_example_files_as_they_are():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "plugins.md").read_text()
    for example in sorted((root / "examples" / "plugins").glob("[!_]*.py")):
        assert example.read_text().rstrip() in page, f"docs/plugins.md does not show {example.name} as it is"


def test_registered_names_are_valid_config_values_and_run_as_their_fields_say(registries_restored):
    """`plugins` imports the module before the fields are checked; the names resolve where the run uses them."""
    import torch

    from verst.algo import compute_advantages
    from verst.config import ConfigError, load_config
    from verst.rewards import build_reward_fn

    chosen = ["--algorithm.advantage-estimator", "median_baseline", "--reward.type", "answer_then_stop"]
    with pytest.raises(ConfigError, match="'median_baseline' is not registered"):
        load_config(None, chosen[:2])  # without the module nothing registers the name
    cfg = load_config(None, ["--plugins", "[examples.plugins.registered]", *chosen])
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 5.0]), torch.tensor([0, 0, 0, 1])
    advantages, returns = compute_advantages(cfg.algorithm, rewards, groups, torch.ones(4, 2))
    assert advantages[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0] and returns is None  # the median, not the mean
    reward = build_reward_fn(cfg.reward)
    scores = [asyncio.run(reward(Sample(label="56", response=r))) for r in ("56", "so 56", "55")]
    assert scores == [1.0, 0.5, 0.0]
    with pytest.raises(ConfigError, match=r"plugins\[0\] = 'examples.plugins.nowhere': cannot import it"):
        load_config(None, ["--plugins", "[examples.plugins.nowhere]"])
