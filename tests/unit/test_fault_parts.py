"""The pure parts of fault handling: exit descriptions, server arguments of a restarted engine, the
reaper's process-tree walk, stack dumps of a live process, and log tails."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from verst.monitor.stacks import dump_process_stacks, handles_dump_signal, log_tail, process_state
from verst.orchestration.engine_actors import with_weight_version
from verst.orchestration.reaper import descendants, process_table
from verst.orchestration.watchdog import describe_exit


def test_exits_are_described_by_code_or_signal():
    assert describe_exit(None) is None
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-9) == "killed by SIGKILL"


def test_a_restarted_engine_gets_the_weight_version_it_serves():
    args = ["--device", "cpu", "--weight-version", "0", "--model-impl", "auto"]
    assert with_weight_version(args, 7) == ["--device", "cpu", "--model-impl", "auto", "--weight-version", "7"]


def test_the_reaper_finds_the_descendants_of_a_process():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(descendants({child.pid}, process_table())) < 1:
            time.sleep(0.05)
        table = process_table()
        found = descendants({os.getpid()}, table)
        assert child.pid in found and len(descendants({child.pid}, table)) == 1
    finally:
        for pid in descendants({child.pid}, process_table()):
            os.kill(pid, 9)
        child.kill()
        child.wait()


def test_an_armed_process_prints_its_stacks_into_its_stderr_file(tmp_path):
    err = tmp_path / "err.log"
    code = ("import time; from verst.monitor.stacks import arm_stack_dump; arm_stack_dump()\n"
            "def waiting_here():\n    print('armed', flush=True)\n    time.sleep(30)\nwaiting_here()")
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr,
                                env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline().strip() == b"armed"
        assert handles_dump_signal(proc.pid)
        assert "waiting_here" in dump_process_stacks(proc.pid, wait_s=0.5)
        assert process_state(proc.pid) in ("sleeping", "running")
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) == "gone"


def test_an_unarmed_process_is_not_signalled():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        assert not handles_dump_signal(proc.pid)
        assert "no stack dump handler" in dump_process_stacks(proc.pid) and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_log_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == ["line 97", "line 98", "line 99"]
    assert log_tail(tmp_path / "missing.log") == []


def test_the_idle_meter_leaves_out_an_engine_that_does_not_answer():
    import asyncio

    from verst.inference_client.client import EngineError
    from verst.inference_client.fleet import EngineFleet, IdleMeter

    async def main():
        fleet = EngineFleet(["http://a", "http://b"])
        busy = iter([(1.0, 2.0), (2.0, 4.0)])

        async def replies(call):  # the fan-out's replies: engine b refuses every connection
            b, up = next(busy)
            return {"http://a": {"busy_seconds": b, "uptime_seconds": up},
                    "http://b": EngineError("http://b/get_server_info", None, "ConnectError: refused")}

        fleet.same_settled = replies
        meter = IdleMeter(fleet)
        assert await meter.read() is None  # the baseline
        assert await meter.read() == 0.5
        await fleet.close()

    asyncio.run(main())
