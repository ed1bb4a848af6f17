"""A driver killed with SIGKILL leaves nothing behind: every process of its run (Ray's, the engines', the
router) ends and its temporary directories are removed, by the reaper the run started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.e2e.test_rl_schedules import REPO, rl_args
from verst.orchestration.reaper import cmdline


def processes_naming(text: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid() and text in cmdline(int(p))]


@pytest.mark.slow
def test_a_killed_driver_leaves_no_process_and_no_temporary_directory(tiny_model_dir, addition_data_dir, tmp_path):
    tmp_root = tempfile.mkdtemp(prefix="vk", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "TMPDIR": tmp_root, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get(
        "PYTHONPATH")]))}
    args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, "--cluster.num-engines", "2",
                   "--rollout.num-rollouts", "50")
    driver = subprocess.Popen([sys.executable, "-m", "verst.cli.main", "train", *args], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        processes = tmp_path / "run" / "processes.json"
        deadline = time.monotonic() + 180
        while not processes.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes.exists(), f"the run did not start (exit code {driver.poll()})"
        time.sleep(3.0)  # the trainer ranks too
        assert processes_naming(tmp_root), "the run's processes should name its temporary directory"
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 30
        while processes_naming(tmp_root) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = {pid: cmdline(pid)[:200] for pid in processes_naming(tmp_root)}
        assert left == {}, left
        assert os.listdir(tmp_root) == []  # the run's temporary directory (Ray's session, the engines') is gone
        run_dir = tmp_path / "run"  # the reaper then writes the run's summary and report
        deadline = time.monotonic() + 120
        while not (run_dir / "report.html").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped"].startswith("killed: ") and summary["segments"][-1]["end"] == "killed", summary
        assert (run_dir / "report.html").stat().st_size > 0
        logs = [entry["log"] for entry in json.loads((run_dir / "processes.json").read_text()) if entry["log"]]
        assert logs and all(log.startswith(str(run_dir / "logs")) and os.path.exists(log) for log in logs), logs
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in processes_naming(tmp_root):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp_root, ignore_errors=True)


@pytest.mark.slow
def test_ctrl_c_ends_the_run_in_one_line_naming_its_latest_checkpoint(tiny_model_dir, addition_data_dir, tmp_path):
    args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, "--rollout.num-rollouts", "200",
                   "--checkpoint.interval", "1")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-m", "verst.cli.main", "train", *args], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        latest = tmp_path / "run" / "checkpoints" / "latest"
        deadline = time.monotonic() + 180
        while not latest.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert latest.exists(), f"no checkpoint was written (exit code {driver.poll()})"
        driver.send_signal(signal.SIGINT)
        _, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 130, stderr
    assert "Traceback" not in stderr and "never retrieved" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("verst train: interrupted by SIGINT; latest checkpoint ") and last.endswith(
        f"continue with: verst train --resume {tmp_path / 'run'}"), last
