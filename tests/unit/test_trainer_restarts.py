"""`fault.max_restarts`: which failures restart a run, from where, and how many times (a stand-in loop)."""

from __future__ import annotations

import asyncio

import pytest

from verst.config import load_config
from verst.monitor import checkpoint_dirs as layout
from verst.orchestration.watchdog import RunFailure
from verst.run.restarts import run_restarting


def config(tmp_path, max_restarts=1):
    return load_config(None, ["--run-dir", str(tmp_path / "run"), "--checkpoint.interval", "1",
                              "--fault.max-restarts", str(max_restarts)])


def saved_checkpoint(tmp_path, step=2):
    step_dir = layout.checkpoints_dir(tmp_path / "run") / layout.step_dir_name(step)
    step_dir.mkdir(parents=True)
    layout.write_latest(step_dir)


class StandInLoop:
    """Raises the given failures in turn, then returns a summary; records the config and restarts of each call."""

    def __init__(self, *failures):
        self.failures, self.calls = list(failures), []

    async def __call__(self, cfg, restarts=0):
        self.calls.append((cfg, restarts))
        if self.failures:
            raise self.failures.pop(0)
        return {"train/steps": 5}


def test_a_dead_trainer_rank_resumes_the_run_from_its_own_latest_checkpoint(tmp_path):
    saved_checkpoint(tmp_path)
    loop = StandInLoop(RunFailure("run stopped: trainer rank 0 died", dead=("trainer-0",)))
    assert asyncio.run(run_restarting(loop, config(tmp_path))) == {"train/steps": 5}
    (first, r0), (second, r1) = loop.calls
    assert (r0, r1) == (0, 1)
    assert first.checkpoint.load is None and second.checkpoint.load == str((tmp_path / "run").resolve())


def test_restarts_stop_at_max_restarts(tmp_path):
    saved_checkpoint(tmp_path)
    dead_rank = RunFailure("trainer rank 1 died", dead=("trainer-1",))
    loop = StandInLoop(dead_rank, dead_rank)
    with pytest.raises(RunFailure, match="trainer rank 1 died"):
        asyncio.run(run_restarting(loop, config(tmp_path, max_restarts=1)))
    assert [restarts for _, restarts in loop.calls] == [0, 1]


def test_other_failures_are_not_restarted(tmp_path):
    saved_checkpoint(tmp_path)
    loop = StandInLoop(RunFailure("engine 1 died", dead=("engine-1",)))
    with pytest.raises(RunFailure, match="engine 1 died"):
        asyncio.run(run_restarting(loop, config(tmp_path)))
    assert len(loop.calls) == 1


def test_a_run_without_a_checkpoint_is_not_restarted_and_says_why(tmp_path):
    loop = StandInLoop(RunFailure("run stopped: trainer rank 0 died", dead=("trainer-0",)))
    with pytest.raises(RunFailure) as caught:
        asyncio.run(run_restarting(loop, config(tmp_path)))
    message = str(caught.value)
    assert message.startswith("run stopped: trainer rank 0 died") and caught.value.trainer_died
    assert "not restarted (fault.max_restarts = 1): the run has saved no checkpoint in" in message
    assert len(loop.calls) == 1
