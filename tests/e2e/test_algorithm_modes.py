"""The engine-side algorithm modes end to end on Ray with the tiny models: true on-policy (engine and
trainer logprobs bitwise equal) and rollout routing replay (R3) for MoE."""

from __future__ import annotations

from tests.e2e.test_rl_schedules import check_run, ray_session, rl_config, run_schedule  # noqa: F401 (fixture)


def test_true_on_policy_sync_run_has_exactly_equal_logprobs(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    """Every step: the trainer's old logprobs (the step's own forward) equal the engine's bit for bit, so
    the mismatch ratio is exactly 1 on every token; the second step's weights reached the engine by sync."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--algorithm.true-on-policy", "true")
    records = check_run(cfg, run_schedule(cfg), steps=2)
    train = [r for r in records if "train/loss" in r]
    assert [r["train/rollout_logprob_abs_diff"] for r in train] == [0.0, 0.0]
    assert all(r["train/mismatch_ratio_min"] == r["train/mismatch_ratio_max"] == 1.0 for r in train)
