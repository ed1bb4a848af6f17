"""SIGTERM (Slurm's and Kubernetes' preemption notice) stops a run as SIGINT does: at the end of the train
step, after a checkpoint (`checkpoint.on_signal`), with summary.json and the report written, one line naming
the checkpoint and the resume command, and status 128 + the signal. Fast tests deliver the signal to this
test process's own handler (`signal.raise_signal`) over stand-in parts; the slow one signals a `verst train`
it started, by pid."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.chaos.stand_ins import drive, saving_run
from tests.e2e.test_rl_schedules import REPO, rl_args
from verst.cli.config_command import run_stoppable
from verst.monitor import checkpoint_dirs as layout
from verst.run import signals


def stopped_run(tmp_path, capsys, signum, *overrides, during=None):
    """A stand-in run of 6 steps that gets `signum` during step 2 (or as `during(step)` says), through the
    command line's handling; (exit status, its last stderr line, the run directory)."""
    run = saving_run(tmp_path, *overrides)

    def signal_at_step_2(step):
        if step == 2:
            signal.raise_signal(signum)

    status = run_stoppable("train", run.cfg, lambda cfg: asyncio.run(drive(run, 6, during or signal_at_step_2)))
    return status, capsys.readouterr().err.strip().splitlines()[-1], tmp_path / "run"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_at_the_step_end_with_a_checkpoint_summary_and_report(tmp_path, capsys, signum):
    status, last, run_dir = stopped_run(tmp_path, capsys, signum, "--checkpoint.interval", "0")
    step_2 = layout.checkpoints_dir(run_dir) / "step_2"
    assert status == 128 + signum
    assert last == (f"verst train: interrupted by {signum.name}; latest checkpoint {step_2}; "
                    f"continue with: verst train --resume {run_dir}")
    assert layout.resolve(run_dir) == step_2  # saved on the signal, complete
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == f"interrupted by {signum.name}" and summary["train/steps"] == 2
    assert summary["segments"][-1]["end"] == f"interrupted by {signum.name}"
    assert (run_dir / "report.html").stat().st_size > 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are the process's again


def test_a_save_that_does_not_fit_in_the_grace_is_not_started(tmp_path, capsys):
    run = saving_run(tmp_path, "--checkpoint.interval", "0")

    def signal_after_a_slow_save(step):
        if step == 2:
            run.checkpointer.last_save_s = signals.STOP_GRACE_S + 1  # as an earlier save measured
            signal.raise_signal(signal.SIGTERM)

    status = run_stoppable("train", run.cfg, lambda cfg: asyncio.run(drive(run, 6, signal_after_a_slow_save)))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    run_dir = tmp_path / "run"
    assert status == 143
    assert last.startswith("verst train: interrupted by SIGTERM; ") and "holds no checkpoint yet" in last, last
    assert layout.read_latest(run_dir) is None
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "interrupted by SIGTERM"


def test_a_save_that_outlasts_the_grace_is_cancelled_and_a_second_signal_stops_at_once(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.setattr(signals, "STOP_GRACE_S", 0.3)
    run = saving_run(tmp_path, "--checkpoint.interval", "0")
    save = run.checkpointer.save

    async def slow_save(*args, **kwargs):
        await asyncio.sleep(5.0)  # past the grace: the run is cancelled in it
        return await save(*args, **kwargs)

    run.checkpointer.save = slow_save

    def signal_at_step_2(step):
        if step == 2:
            signal.raise_signal(signal.SIGTERM)

    started = time.monotonic()
    status = run_stoppable("train", run.cfg, lambda cfg: asyncio.run(drive(run, 6, signal_at_step_2)))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert time.monotonic() - started < 4.0
    assert status == 143 and last.startswith("verst train: interrupted by SIGTERM; ") and "no checkpoint" in last
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped"] == "interrupted by SIGTERM"

    def signal_twice(step):
        if step == 2:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)

    status, last, _ = stopped_run(tmp_path / "again", capsys, signal.SIGINT, "--checkpoint.interval", "0",
                                  during=signal_twice)
    assert status == 130 and last.startswith("verst train: interrupted by SIGINT; ") and "no checkpoint" in last


def test_checkpoint_on_signal_off_stops_where_the_run_is(tmp_path, capsys):
    status, last, run_dir = stopped_run(tmp_path, capsys, signal.SIGTERM, "--checkpoint.interval", "0",
                                        "--checkpoint.on-signal", "false")
    assert status == 143 and "holds no checkpoint yet" in last, last
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "interrupted by SIGTERM"


@pytest.mark.slow
def test_sigterm_to_verst_train_saves_a_checkpoint_and_exits_as_ctrl_c_does(tiny_model_dir, addition_data_dir,
                                                                             tmp_path):
    args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, "--rollout.num-rollouts", "200",
                   "--checkpoint.interval", "50")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-m", "verst.cli.main", "train", *args], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 180
        while driver.poll() is None and time.monotonic() < deadline and not any(
                "train/loss" in r for r in _rows(run_dir)):
            time.sleep(0.2)
        assert driver.poll() is None, f"the run ended before a step (exit code {driver.returncode})"
        driver.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, stderr = driver.communicate(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 143, stderr
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr
    latest = layout.read_latest(run_dir)
    assert latest is not None and layout.resolve(run_dir) == latest  # saved on the signal (interval 50)
    last = stderr.strip().splitlines()[-1]
    assert last == (f"verst train: interrupted by SIGTERM; latest checkpoint {latest}; "
                    f"continue with: verst train --resume {run_dir}"), last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "interrupted by SIGTERM" and summary["train/steps"] == int(latest.name[5:])
    assert (run_dir / "report.html").exists()
    assert took < signals.STOP_GRACE_S + 30, took


def _rows(run_dir):
    from verst.monitor import read_metrics

    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def test_sigterm_stops_verst_sft_as_ctrl_c_does_with_summary_and_report(tiny_model_dir, addition_data_dir, tmp_path,
                                                                        capsys, monkeypatch):
    from tests.e2e.test_sft import sft_args
    from verst.cli.main import main
    from verst.monitor.progress import RunProgress

    step = RunProgress.step

    def signal_at_step_3(progress, number, metrics):
        step(progress, number, metrics)
        if number == 3:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(RunProgress, "step", signal_at_step_3)
    run_dir = tmp_path / "run"
    status = main(sft_args(tiny_model_dir, addition_data_dir, run_dir, "--sft.num-steps", "8", "--sft.batch-size", "4",
                           "--eval.max-prompts", "2", "--checkpoint.interval", "1"))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 143
    assert last == (f"verst sft: interrupted by SIGTERM; latest checkpoint {run_dir / 'checkpoints' / 'step_2'}; "
                    f"continue with: verst sft --resume {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == "interrupted by SIGTERM" and summary["train/steps"] == 3
    assert [s["end"] for s in summary["segments"]] == ["interrupted by SIGTERM"]
    assert (run_dir / "report.html").stat().st_size > 0
