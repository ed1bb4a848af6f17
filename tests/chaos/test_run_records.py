"""What a stopped run leaves: a resumed run's totals over every segment (summary.json, the report's headline),
summary.json and report.html after a killed driver (written by its reaper), and every process's log in the
run directory, which outlives the run's temporary directory."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from tests.chaos.stand_ins import drive, saving_run
from verst.monitor import checkpoint_dirs as layout
from verst.monitor.segments import read_segments
from verst.orchestration import reaper
from verst.run.checkpointer import prepare_resume


def test_a_resumed_run_reports_its_totals_over_every_segment(tmp_path):
    first = saving_run(tmp_path, "--rollout.num-rollouts", "3")
    asyncio.run(drive(first, 3))
    first.monitor.segments.close("interrupted by SIGINT")  # as the first segment's stop wrote it
    resumed_cfg = first.cfg.model_copy(update={"checkpoint": first.cfg.checkpoint.model_copy(
        update={"load": str(tmp_path / "run")})})
    point = prepare_resume(resumed_cfg)
    time.sleep(0.2)
    second = saving_run(tmp_path, "--rollout.num-rollouts", "6", "--checkpoint.load", str(tmp_path / "run"))
    asyncio.run(second.resume(point))
    asyncio.run(drive(second, 3))
    summary = second.monitor.finish(second.version, second.evaluator.history, second.lanes,
                                    second.evaluator.score_key)
    segments = summary["segments"]
    assert [(s["from_step"], s["to_step"], s["end"]) for s in segments] == [
        (0, 3, "interrupted by SIGINT"), (3, 6, "finished")]
    assert summary["time/total_s"] == sum(s["seconds"] for s in segments) > segments[-1]["seconds"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["time/total_s"] == summary["time/total_s"]
    page = (tmp_path / "run" / "report.html").read_text()
    assert "over 2 segments: " in page and "(steps 0–3, interrupted by SIGINT)" in page, page[:2000]


def test_a_killed_drivers_run_gets_its_summary_and_report_from_the_reaper(tmp_path):
    run = saving_run(tmp_path)
    asyncio.run(drive(run, 3))  # the run logged 3 steps ...
    run_dir = tmp_path / "run"  # ... and its driver was killed: no summary, its segment still "running"
    assert not (run_dir / "summary.json").exists() and read_segments(run_dir)[-1].end == "running"
    (run_dir / "config.yaml").write_text("schedule: sync\nsync:\n  transport: disk\n")

    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the driver stand-in
    tmp = tmp_path / "verst-tmp"
    tmp.mkdir()
    watcher = subprocess.Popen([sys.executable, reaper.__file__, "--pid", str(driver.pid), "--dir", str(tmp)],
                               stdin=subprocess.PIPE, start_new_session=True)
    try:
        watcher.stdin.write(f"run {run_dir}\n".encode())
        watcher.stdin.flush()
        time.sleep(1.0)  # the reaper has read the line
        driver.kill()
        driver.wait()
        watcher.wait(timeout=120)
    finally:
        for proc in (driver, watcher):
            if proc.poll() is None:
                proc.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"].startswith("killed: ") and summary["train/steps"] == 3
    assert summary["schedule"] == "sync" and summary["sync/transport"] == "disk"
    assert summary["eval/version_before"] == 0 and summary["eval/version_after"] == 3
    assert [s.end for s in read_segments(run_dir)] == ["killed"]
    assert (run_dir / "report.html").stat().st_size > 0
    assert not tmp.exists()  # the run's temporary directory went first


def test_a_reaper_told_the_run_ended_writes_nothing(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tmp = tmp_path / "verst-tmp"
    tmp.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    watcher = subprocess.Popen([sys.executable, reaper.__file__, "--pid", str(driver.pid), "--dir", str(tmp)],
                               stdin=subprocess.PIPE, start_new_session=True)
    try:
        watcher.stdin.write(f"run {run_dir}\nrun -\n".encode())
        watcher.stdin.flush()
        time.sleep(1.0)
        driver.kill()
        driver.wait()
        watcher.wait(timeout=60)
    finally:
        for proc in (driver, watcher):
            if proc.poll() is None:
                proc.kill()
    assert list(run_dir.iterdir()) == []


def test_a_process_keeps_its_output_in_the_run_directory(tmp_path):
    log = tmp_path / "logs" / "trainer-0.log"
    code = ("import os, sys; from verst.monitor.stacks import arm_stack_dump; "
            f"arm_stack_dump({str(log)!r}); print('to stdout', flush=True); print('to stderr', file=sys.stderr, "
            "flush=True); os.write(2, b'from C\\n')")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout == "" and child.stderr == ""
    assert log.read_text() == "to stdout\nto stderr\nfrom C\n"


def test_a_run_stopped_by_a_failure_records_its_segment_and_what_ran_when_the_report_cannot_be_read(tmp_path):
    run = saving_run(tmp_path)
    asyncio.run(drive(run, 2))
    (tmp_path / "run" / "metrics.jsonl").write_text("not json\n{}\n")  # unreadable: the report cannot be drawn
    lines = run.monitor.stopped(run.version, run.evaluator.history, run.lanes, run.evaluator.score_key,
                                "failed: a test")
    assert lines[0].startswith("what ran: 2 train steps in ") and lines[1].startswith("summary: ")
    assert lines[2].startswith("report.html not written: ValueError: ") and "verst report" in lines[2], lines
    assert layout.read_latest(tmp_path / "run").name == "step_2"
