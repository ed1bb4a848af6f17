"""Faults during a checkpoint save (tiny model): the driver killed in the middle of a save, and a full
disk. Either way the previous checkpoint stays `latest`, complete, and the run resumes from it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.chaos.runs import BackgroundRun
from tests.e2e.test_resume import SEEDED, kill_tagged, verst
from tests.e2e.test_rl_schedules import rl_args, rl_config, run_schedule
from verst.monitor import checkpoint_dirs as layout
from verst.monitor import read_metrics
from verst.orchestration.watchdog import RunFailure


def check_finished(run_dir: Path, steps: int) -> None:
    from transformers import AutoModelForCausalLM

    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == list(range(1, steps + 1))
    assert layout.read_latest(run_dir).name == f"step_{steps}"
    assert list(layout.checkpoints_dir(run_dir).glob(f"{layout.TMP_PREFIX}step_*")) == []
    AutoModelForCausalLM.from_pretrained(run_dir / "hf")  # the final model loads


@pytest.mark.slow
def test_a_full_disk_during_a_save_stops_the_run_naming_the_checkpoint_and_keeps_the_previous_one(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path, monkeypatch):
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", "4",
                    "--checkpoint.interval", "1")
    fsync_tree = layout._fsync_tree

    def full_disk_at_step_2(root):
        if root.name == f"{layout.TMP_PREFIX}step_2":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fsync_tree(root)

    monkeypatch.setattr(layout, "_fsync_tree", full_disk_at_step_2)
    run = BackgroundRun(cfg)
    with pytest.raises(RunFailure) as caught:
        run.result()
    monkeypatch.undo()
    step_1 = layout.checkpoints_dir(run.run_dir) / "step_1"
    message = str(caught.value)
    assert message.startswith(f"run stopped: checkpoint {layout.checkpoints_dir(run.run_dir) / 'step_2'} not saved: "
                              f"OSError: [Errno 28] No space left on device; {step_1} is still the latest"), message
    assert f"continue with: make room under {run.run_dir}, then verst train --resume {run.run_dir}" in message
    assert layout.resolve(run.run_dir) == step_1  # complete: manifest and trainer state
    assert "No space left on device" in json.loads((run.run_dir / "summary.json").read_text())["stopped"]

    resumed = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"load": cfg.run_dir})})
    assert run_schedule(resumed)["train/steps"] == 4
    check_finished(run.run_dir, steps=4)


STALL = "tests.chaos.stalled_commit"  # `verst` whose commit of one step stops before its rename


@pytest.mark.slow
def test_a_driver_killed_during_a_save_resumes_from_the_previous_checkpoint(ray_session, tiny_model_dir,
                                                                            addition_data_dir, tmp_path):
    steps, run_dir, marker = 4, tmp_path / "run", tmp_path / "stalled"
    args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", str(steps),
                   "--checkpoint.interval", "1")
    env = {"VERST_TEST_STALL_STEP": "2", "VERST_TEST_STALL_MARKER": str(marker)}
    tag, ray_tmp = uuid.uuid4().hex, tempfile.mkdtemp(prefix="vr", dir="/tmp")
    try:
        proc = verst(["train", *args], tag, ray_tmp, env, module=STALL)
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the save of step 2 did not start within 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # in the middle of the save of step 2: written, not renamed
        proc.wait()
        kill_tagged(tag)
        step_1 = layout.checkpoints_dir(run_dir) / "step_1"
        assert (layout.checkpoints_dir(run_dir) / f"{layout.TMP_PREFIX}step_2").is_dir()
        assert layout.read_latest(run_dir) == step_1 and layout.resolve(run_dir) == step_1

        resumed = verst(["train", "--resume", str(run_dir)], tag, ray_tmp)
        out, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, out
        assert f"resumed from {step_1} at step 1" in out
    finally:
        kill_tagged(tag)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    check_finished(run_dir, steps)
