"""A full disk under the run directory, during a save and during metrics writing (a stand-in that raises
ENOSPC, not a real small filesystem: CI cannot mount one): the run stops with one screen naming the OS
error, the free space and the last good checkpoint, and writes summary.json and report.html with what ran."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import Future

import pytest

from tests.chaos.stand_ins import CheckpointException, SavingRanks, check_screen, no_space, run_to_failure, saving_run
from tests.e2e.test_rl_schedules import REPO, rl_args
from verst.monitor import checkpoint_dirs as layout
from verst.monitor import read_metrics
from verst.monitor.logger import JsonlSink


def test_a_full_disk_during_a_trainer_save_stops_the_run_in_one_screen_with_summary_and_report(tmp_path):
    run = saving_run(tmp_path, ranks=SavingRanks(fail_at=3, error=no_space()))
    failure = run_to_failure(run, steps=6)
    run_dir, message = tmp_path / "run", str(failure)
    step_2 = layout.checkpoints_dir(run_dir) / "step_2"
    assert message.startswith(f"run stopped: checkpoint {layout.checkpoints_dir(run_dir) / 'step_3'} not saved: "
                              "trainer rank 0's write failed: OSError: [Errno 28] No space left on device; "
                              f"{step_2} is still the latest checkpoint\n"), message
    check_screen(message, names=["trainer rank 0", "[Errno 28] No space left on device", "free space: "],
                 todo=f"continue with: make room under {run_dir}, then verst train --resume {run_dir} "
                      f"(from {step_2})")
    assert layout.read_latest(run_dir) == step_2 and layout.resolve(run_dir) == step_2
    assert not list(layout.checkpoints_dir(run_dir).glob(f"{layout.TMP_PREFIX}*"))  # its space given back
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"].startswith("failed: checkpoint ") and "No space left on device" in summary["stopped"]
    assert summary["train/steps"] == run.version >= 3
    assert (run_dir / "report.html").stat().st_size > 0
    assert f"summary: {run_dir / 'summary.json'}" in message and f"report: {run_dir / 'report.html'}" in message


def test_a_rank_whose_disk_refuses_its_error_record_names_the_os_error_in_the_record(tmp_path, monkeypatch):
    from verst.trainer.persistence import _record_write

    write_text = pathlib.Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name.startswith(".failed_rank"):
            path.touch()  # created, as a full disk still allows, then its text refused
            raise no_space()
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    written: Future = Future()
    written.set_exception(CheckpointException({0: (no_space(), "Traceback ...")}))
    _record_write(tmp_path, 0, written)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["failed_rank0.errno28"]
    with pytest.raises(layout.TrainerWriteError) as caught:
        layout.wait_trainer_writes(tmp_path, ranks=1, step=3, timeout_s=5)
    assert str(caught.value) == "trainer rank 0's write failed: OSError: [Errno 28] No space left on device"
    assert caught.value.out_of_space


def test_a_rank_records_the_os_error_behind_a_failed_write_on_one_line(tmp_path):
    from verst.trainer.persistence import _record_write

    try:
        try:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        except RuntimeError:
            raise no_space() from None
    except OSError as error:
        written: Future = Future()
        written.set_exception(CheckpointException({0: (error, "Traceback ...")}))
    _record_write(tmp_path, 0, written)
    assert (tmp_path / "failed_rank0").read_text() == "OSError: [Errno 28] No space left on device"


def test_a_full_disk_during_metrics_writing_stops_the_run_in_one_screen_with_summary_and_report(tmp_path,
                                                                                                 monkeypatch):
    write, rows = JsonlSink.write, []

    def fills_after_five_rows(sink, step, metrics):  # then half a line goes in, and ENOSPC (as a real disk may)
        rows.append(step)
        if len(rows) > 5:
            sink._file.write(f'{{"step": {step}, "train/lo')
            sink._file.flush()
            raise no_space()
        write(sink, step, metrics)

    monkeypatch.setattr(JsonlSink, "write", fills_after_five_rows)
    run = saving_run(tmp_path)
    failure = run_to_failure(run, steps=8)
    run_dir, message = tmp_path / "run", str(failure)
    latest = layout.read_latest(run_dir)
    assert message.startswith(f"run stopped: the metrics of step {run.version} were not written to "
                              f"{run_dir / 'metrics.jsonl'}: OSError: [Errno 28] No space left on device\n"), message
    check_screen(message, names=[str(run_dir / "metrics.jsonl"), "[Errno 28] No space left on device",
                                 "free space: "],
                 todo=f"continue with: make room under {run_dir}, then verst train --resume {run_dir} (from {latest})")
    records = read_metrics(run_dir)  # the row cut short is left out
    assert records and all("step" in r for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"].startswith("failed: the metrics of step ")
    assert (run_dir / "report.html").stat().st_size > 0


def test_a_resume_drops_a_metrics_row_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/loss": 0.4}\n'
                                            '{"step": 3, "trai')
    layout.trim_metrics(tmp_path, 2)
    assert read_metrics(tmp_path) == [{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": 0.4}]


def test_a_failed_save_of_the_rollout_side_names_it_and_removes_the_temporary_directory(tmp_path):
    from tests.chaos.stand_ins import SavingManager

    class FullManager(SavingManager):
        def save_state(self, path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    run = saving_run(tmp_path)
    run.rollouts.lanes[0].rollout = FullManager()
    failure = run_to_failure(run, steps=3)
    run_dir = tmp_path / "run"
    check_screen(str(failure), names=["the rollout manager's save failed", "[Errno 28] No space left on device",
                                      "rollout.pkl"],
                 todo="no checkpoint to continue from")
    assert not list(layout.checkpoints_dir(run_dir).glob(f"{layout.TMP_PREFIX}*"))


@pytest.mark.slow
def test_verst_train_on_a_real_30_mb_tmpfs_stops_in_one_screen(tiny_model_dir, addition_data_dir, tmp_path):
    """The issue's own set-up: a 30 MB tmpfs (mounting needs root: skipped elsewhere), a save every 5 steps, every
    checkpoint kept (three of the tiny model's fit in 30 MB, so the default `keep_last` would never fill it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run_dir = disk / "run"
        args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, "--run-dir", str(run_dir),
                       "--rollout.num-rollouts", "200", "--checkpoint.interval", "5", "--checkpoint.keep-last", "0")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "verst.cli.main", "train", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        stderr = done.stderr
        assert done.returncode == 1, stderr
        assert "Traceback" not in stderr and "pid=" not in stderr, stderr
        screen = stderr[stderr.index("verst train: run stopped: "):]
        latest = layout.read_latest(run_dir)
        check_screen(screen, names=["not saved: trainer rank 0's write failed: OSError: [Errno 28] No space left on "
                                    "device", f"{latest} is still the latest checkpoint", "free space: "],
                     todo=f"continue with: make room under {run_dir}, then verst train --resume {run_dir}")
        assert len(stderr.strip().splitlines()) <= 12, stderr
        assert "No space left on device" in json.loads((run_dir / "summary.json").read_text())["stopped"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
