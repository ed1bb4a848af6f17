"""A trainer rank killed during an RL run stops it with an error naming the rank, how it ended and its
log (and the last checkpoint, when the run has one); with `fault.max_restarts` the run restarts from its
latest checkpoint and finishes."""

from __future__ import annotations

import signal

import pytest

from tests.chaos.runs import BackgroundRun, signal_quietly
from tests.e2e.test_rl_schedules import rl_config
from tests.metrics_doc import undocumented
from verst.monitor import read_metrics
from verst.orchestration.watchdog import RunFailure


def test_a_killed_trainer_rank_stops_the_run_naming_it(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--cluster.placement", "disaggregated", "--rollout.num-rollouts", "20")
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    (run.run_dir / "checkpoints" / "latest").mkdir(parents=True)  # as a checkpointing run leaves it
    signal_quietly(run.pid_of("trainer rank 0"), signal.SIGKILL)
    with pytest.raises(RunFailure) as caught:
        run.result()
    message = str(caught.value)
    assert message.startswith("run stopped: trainer rank 0 (pid "), message
    assert "died" in message and "log " in message, message
    assert f"last checkpoint: {run.run_dir / 'checkpoints' / 'latest'}" in message
    assert "engine 0" not in message.splitlines()[0]  # the engines lived


@pytest.mark.slow
def test_a_killed_trainer_rank_restarts_the_run_from_its_last_checkpoint(ray_session, tiny_model_dir,
                                                                         addition_data_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from verst.run.training import TrainerGroup

    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--cluster.placement", "disaggregated", "--rollout.num-rollouts", "5",
                    "--checkpoint.interval", "1", "--fault.max-restarts", "1")
    on_ranks, calls, killed = TrainerGroup.on_ranks, [], []

    def kill_as_step_3_starts(group, step, *args):
        calls.append(step)
        if len(calls) == 3:  # train step 3, after step 2's checkpoint
            killed.append(run.pid_of("trainer rank 0"))
            signal_quietly(killed[0], signal.SIGKILL)
        return on_ranks(group, step, *args)

    monkeypatch.setattr(TrainerGroup, "on_ranks", kill_as_step_3_starts)
    run = BackgroundRun(cfg)
    summary = run.result(timeout_s=480)
    assert len(killed) == 1 and summary["train/steps"] == 5
    records = read_metrics(run.run_dir)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]  # steps after the restart continue from the checkpoint's
    # Restarted from step 2's checkpoint, or step 1's when step 2's write had not ended when the rank died.
    restarted = [r.get("fault/trainer_restarts") for r in train]
    assert restarted in ([None, None, 1, 1, 1], [None, 1, 1, 1, 1]), restarted
    assert [r["sync/version"] for r in train] == [1, 2, 3, 4, 5]
    assert undocumented(records) == []
    AutoModelForCausalLM.from_pretrained(run.run_dir / "hf")  # the final model loads
