"""A trainer rank killed during an RL run stops it with an error naming the rank, how it ended and its
log (and the last checkpoint, when the run has one)."""

from __future__ import annotations

import signal

import pytest

from tests.chaos.runs import BackgroundRun, signal_quietly
from tests.e2e.test_rl_schedules import rl_config
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
