"""`verst sim` end to end: the real control plane (sglang-router, rollout manager, buffer, weight syncer, engine
supervisor, the schedules' loops) over 64 simulated engines in a process of their own and a simulated trainer.
Every served group is accounted for exactly, faults are survived, and the scale summary is written."""

import json

import pytest

from tests.metrics_doc import undocumented
from verst.monitor.run_dir import read_metrics
from verst.sim.command import load_sim, run_sim


def sim_args(tmp_path, model, *extra):
    return ["--run-dir", str(tmp_path / "run"), "--model.path", str(model), "--logging.progress", "false",
            "--logging.tensorboard", "false", "--sim.total-params", "1e9", "--sim.active-params", "1e9",
            "--sync.bucket-bytes", str(2**32), *extra]


# A few hundred steps with one request per sample; one request per group changes how requests are sent, not
# the accounting, so half as many steps cover it.
@pytest.mark.parametrize(("request_per", "steps"), [("sample", 240), ("group", 120)])
def test_64_engines_fully_async_with_engines_killed_and_stalled(tmp_path, tiny_model_dir, registries_restored,
                                                                request_per, steps):
    per_step = 4
    cfg, sim = load_sim(None, sim_args(
        tmp_path, tiny_model_dir, "--schedule", "fully_async", "--cluster.num-engines", "64",
        "--rollout.batch-size", str(per_step), "--rollout.n-samples-per-prompt", "4",
        "--rollout.num-rollouts", str(steps), "--rollout.max-response-tokens", "64", "--rollout.max-in-flight", "256",
        "--rollout.dynamic-filter", "zero_std", "--buffer.max-staleness", "2", "--eval.interval", "60",
        "--eval.max-prompts", "16", "--fault.health-interval-s", "0.5", "--fault.health-failures", "2",
        "--sim.speedup", "50", "--sim.response-tokens-mean", "32", "--sim.zero-variance-fraction", "0.2",
        "--sim.kill-fraction", "0.05", "--sim.stall-fraction", "0.01", "--sim.fault-after-steps", "20",
        "--sim.engine-restart-s", "20", "--sim.prompts", "1024", "--rollout.request-per", request_per,
        "--rollout.submission-granularity", request_per))
    summary, scale = run_sim(cfg, sim)

    assert summary["train/steps"] == steps
    accounting = scale["accounting"]
    assert accounting["problems"] == [], accounting  # every served group trained once or dropped with a reason
    assert accounting["trained"] == steps * per_step
    assert set(accounting["discarded"]) <= {"filtered", "stale", "aborted"}
    assert scale["faults"]["die"] == 3 and scale["faults"]["stall"] == 1  # 5% and 1% of 64
    assert scale["faults"]["engine_restarts"] >= 4  # each restarted (once: a stale verdict restarts none again)
    assert 0 < scale["engine_busy_fraction"] <= 1 and scale["control_ms_per_trajectory"] > 0
    assert scale["sync"]["pushes"] == steps
    assert scale["cpu_s"]["weight_sync"] > 0  # the syncer's own process, metered by its pid
    assert json.loads((tmp_path / "run" / "scale.json").read_text()) == scale
    assert (tmp_path / "run" / "report.html").is_file()
    assert undocumented(read_metrics(tmp_path / "run")) == []


def test_agentic_turns_through_the_session_server_on_the_sync_schedule(tmp_path, tiny_model_dir, registries_restored):
    cfg, sim = load_sim(None, sim_args(
        tmp_path, tiny_model_dir, "--schedule", "sync", "--cluster.num-engines", "8", "--rollout.batch-size", "4",
        "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "4", "--rollout.max-response-tokens", "24",
        "--rollout.max-context-tokens", "1024", "--rollout.dynamic-filter", "zero_std", "--sim.speedup", "50",
        "--sim.agent-turns", "3", "--sim.env-seconds", "1", "--sim.response-tokens-mean", "12",
        "--sim.response-tokens-sigma", "0", "--sim.prompts", "256"))
    summary, scale = run_sim(cfg, sim)

    assert summary["train/steps"] == 4
    accounting = scale["accounting"]
    assert accounting["problems"] == [], accounting
    assert accounting["trained"] == 16 and accounting["dropped_in_steps"] == accounting["served"] - 16 - \
        accounting["returned"]
    rows = read_metrics(tmp_path / "run")
    assert undocumented(rows) == []
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    # every episode ran its three turns: 12 sampled tokens each, and the environment's 64 between them
    assert samples and all(s["response_tokens"] >= 3 * 12 + 2 * 64 for s in samples)
    assert scale["engine_requests"] >= 3 * accounting["trained"] * 4
    # the control plane's CPU is shared over the trajectories the agents finished: three requests each here
    assert 2.5 < scale["engine_requests"] / scale["trajectories_in_window"] < 3.5


def test_agentic_trajectories_that_end_at_their_first_reply_are_counted_as_trajectories(tmp_path, tiny_model_dir,
                                                                                          registries_restored):
    cfg, sim = load_sim(None, sim_args(
        tmp_path, tiny_model_dir, "--schedule", "sync", "--cluster.num-engines", "4", "--rollout.batch-size", "4",
        "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "3", "--rollout.max-response-tokens", "8",
        "--sim.speedup", "50", "--sim.agent-turns", "3", "--sim.response-tokens-mean", "12",
        "--sim.response-tokens-sigma", "0", "--sim.prompts", "256"))
    _, scale = run_sim(cfg, sim)

    # every reply hits max_response_tokens, so each episode ends after one request of its three allowed turns; the
    # window (from the start to the last step, the final evaluation outside it) holds the step-0 evaluation's 64
    # and the three steps' 48, each counted once on both sides
    assert scale["engine_requests"] == scale["trajectories_in_window"] == 64 + 3 * 4 * 4
    assert scale["control_ms_per_trajectory"] == pytest.approx(
        scale["control_ms_per_request"] * scale["engine_requests"] / scale["trajectories_in_window"])


def test_the_runs_config_file_holds_the_sim_settings_and_reloads_to_the_same_run(tmp_path, tiny_model_dir,
                                                                                  registries_restored):
    cfg, sim = load_sim(None, sim_args(
        tmp_path, tiny_model_dir, "--schedule", "sync", "--cluster.num-engines", "2", "--rollout.batch-size", "2",
        "--rollout.n-samples-per-prompt", "2", "--rollout.num-rollouts", "2", "--rollout.max-response-tokens", "8",
        "--sim.speedup", "40", "--sim.response-tokens-mean", "6", "--sim.prompts", "64", "--sim.warmup-steps", "1"))
    run_sim(cfg, sim)

    again_cfg, again_sim = load_sim(str(tmp_path / "run" / "config.yaml"), [])
    assert again_sim == sim and again_cfg == cfg


@pytest.mark.parametrize("request_per", ["sample", "group"])
def test_fully_async_partial_rollouts_continue_the_trajectories_a_weight_push_aborted(tmp_path, tiny_model_dir,
                                                                                     registries_restored, request_per):
    """Every push aborts the requests in flight (sync.pause_mode = 'abort'); with partial rollouts they go on with
    the new weights, so no group is lost to the pushes and the trained samples span versions."""
    steps, per_step = 12, 2
    cfg, sim = load_sim(None, sim_args(
        tmp_path, tiny_model_dir, "--schedule", "fully_async", "--cluster.num-engines", "2",
        "--rollout.batch-size", str(per_step), "--rollout.n-samples-per-prompt", "4",
        "--rollout.num-rollouts", str(steps), "--rollout.max-response-tokens", "1024", "--rollout.max-in-flight", "32",
        "--sync.pause-mode", "abort", "--rollout.partial-rollout", "true", "--sim.speedup", "50",
        "--sim.response-tokens-mean", "512", "--sim.prompts", "256", "--rollout.request-per", request_per,
        "--rollout.submission-granularity", request_per))
    summary, scale = run_sim(cfg, sim)

    assert summary["train/steps"] == steps and scale["accounting"]["problems"] == []
    assert "aborted" not in scale["accounting"]["discarded"]  # the pushes' aborts were continued, not dropped
    records = read_metrics(tmp_path / "run")
    continued = [r["rollout/continued_ratio"] for r in records if "rollout/continued_ratio" in r]
    assert continued and max(continued) > 0
    assert max(r.get("rollout/mixed_version_ratio", 0) for r in records) > 0
    assert undocumented(records) == []
