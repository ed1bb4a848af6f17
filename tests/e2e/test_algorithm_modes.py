"""The engine-side algorithm modes end to end on Ray with the tiny models: true on-policy (engine and
trainer logprobs bitwise equal) and rollout routing replay (R3) for MoE."""

from __future__ import annotations

import pytest

from tests.e2e.test_rl_schedules import check_run, ray_session, rl_config, run_schedule  # noqa: F401 (fixture)
from tests.moe_models import near_tie_moe


def test_true_on_policy_sync_run_has_exactly_equal_logprobs(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    """Every step: the trainer's old logprobs (the step's own forward) equal the engine's bit for bit, so
    the mismatch ratio is exactly 1 on every token; the second step's weights reached the engine by sync."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--algorithm.true-on-policy", "true")
    records = check_run(cfg, run_schedule(cfg), steps=2)
    train = [r for r in records if "train/loss" in r]
    assert [r["train/rollout_logprob_abs_diff"] for r in train] == [0.0, 0.0]
    assert all(r["train/mismatch_ratio_min"] == r["train/mismatch_ratio_max"] == 1.0 for r in train)


@pytest.fixture(scope="module")
def near_tie_moe_dir(tmp_path_factory):
    return near_tie_moe(tmp_path_factory.mktemp("models") / "tiny-moe")


@pytest.mark.parametrize("mode", [pytest.param("measure", marks=pytest.mark.slow), "replay"])
def test_routing_replay_sync_run(ray_session, near_tie_moe_dir, addition_data_dir, tmp_path, mode):  # noqa: F811
    """The engines' routed experts reach the trainer on the samples; its routers disagree with them on some
    choices (train/routing_mismatch_rate) and, replayed, its logprobs equal the engines' within 1e-6."""
    cfg = rl_config(tmp_path, near_tie_moe_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--algorithm.routing-replay", mode, "--rollout.max-response-tokens", "8")
    records = check_run(cfg, run_schedule(cfg), steps=2)
    train = [r for r in records if "train/loss" in r]
    assert all(0.0 < r["train/routing_mismatch_rate"] < 0.5 for r in train)
    drift = max(max(r["train/mismatch_ratio_max"] - 1, 1 - r["train/mismatch_ratio_min"]) for r in train)
    if mode == "replay":
        assert drift < 1e-6  # |log ratio| < 1e-6 on every token
    else:
        assert drift > 1e-4  # tokens whose experts differ
