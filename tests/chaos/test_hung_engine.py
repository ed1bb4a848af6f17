"""An engine that stops answering (SIGSTOP) is found within the documented bound, (fault.health_failures + 1) x
fault.health_interval_s of its last answer; the stacks of every process are dumped before it is restarted; its
whole outage, from its last answer to its serving again, is in `fault/outage_seconds` and, per step, in
`time/engine_outage_s`, which the report draws as "engine outage". Fast: the supervisor over an HTTP stand-in
of an engine (bound to 127.0.0.1, a free port); slow: a real run whose engine the test stops by its pid."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.runs import BackgroundRun, signal_quietly
from tests.chaos.test_engine_faults import two_engine_config
from tests.metrics_doc import undocumented
from verst.config import load_config
from verst.monitor import read_metrics
from verst.monitor.report_data import load_run, time_breakdown
from verst.orchestration.health import EngineSupervisor, Outages, RestartWeights
from verst.orchestration.watchdog import RunFailure


class FakeEngine:
    """/health and /model_info (the weight version) over raw HTTP; `hung` leaves /health unanswered (a stopped server)."""

    def __init__(self):
        self.hung, self.version, self.server, self.url = False, 0, None, ""

    async def start(self) -> FakeEngine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader, writer):
        request = (await reader.readline()).decode()
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if "/health" in request and self.hung:
            await asyncio.sleep(3600)  # accepted, never answered: as a SIGSTOPped server
        body = json.dumps({"weight_version": str(self.version)}) if "/model_info" in request else "{}"
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"Connection: close\r\n\r\n{body}".encode())
        await writer.drain()
        writer.close()


class Engines:
    """The engine actors: `halt` kills the (hung) server, `restart` brings it back at a version."""

    def __init__(self, engine: FakeEngine, restart_s: float, fail_restart: bool = False):
        self.engine, self.restart_s, self.fail_restart, self.calls = engine, restart_s, fail_restart, []

    def halt(self, index):
        self.calls.append(("halt", index, time.perf_counter()))

    def restart(self, index, model, version):
        time.sleep(self.restart_s)
        if self.fail_restart:
            raise RuntimeError()
        self.engine.hung, self.engine.version = False, version
        self.calls.append(("restart", index, time.perf_counter()))


class _Ref:
    def __init__(self):
        self._future = concurrent.futures.Future()
        self._future.set_result(None)

    def future(self):
        return self._future


class _Router:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, url):
        self.calls.append((self.name, url))
        return _Ref()


class Manager:
    """The rollout manager's actor, whose router takes engines out and back."""

    def __init__(self):
        self.calls = []
        self.actor = type("Actor", (), {"remove_engine": _Router(self.calls, "remove"),
                                        "add_engine": _Router(self.calls, "add")})()


class Watchdog:
    def __init__(self, tmp_path: Path):
        self.tmp_path, self.dumps, self.failures = tmp_path, [], []

    def dump(self, phase):
        self.dumps.append((phase, time.perf_counter()))
        return self.tmp_path / "stacks" / phase.replace(" ", "-")

    def fail(self, failure):
        self.failures.append(failure)


class Processes:
    def __init__(self, tmp_path: Path):
        self.log_dir = tmp_path / "logs"


async def hang_and_recover(tmp_path, interval=0.2, failures=3, restart_s=0.3, fail_restart=False):
    """Engine 0 answers, then hangs; the supervisor's poll finds it. Returns (supervisor, engines, watchdog,
    the hang's time, the step start) once it serves again (or failed to)."""
    engine = await (FakeEngine()).start()
    fault = load_config(None, ["--fault.health-interval-s", str(interval),
                               "--fault.health-failures", str(failures)]).fault
    engines, watchdog = Engines(engine, restart_s, fail_restart), Watchdog(tmp_path)

    async def restart_weights():
        return RestartWeights("model", 0)

    supervisor = EngineSupervisor(fault, engines, [Manager()], [engine.url], Processes(tmp_path), watchdog,
                                  restart_weights, served_version=lambda: 0)
    async with supervisor:
        step_start = time.perf_counter()
        await asyncio.sleep(3 * interval)  # answered polls
        engine.hung, hung_at = True, time.perf_counter()
        deadline = time.perf_counter() + 10 * (failures + 1) * interval + restart_s
        while not (supervisor.restarts or watchdog.failures) and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
    engine.server.close()
    return supervisor, engines, watchdog, hung_at, step_start


def test_a_hung_engine_is_found_within_the_bound_dumped_restarted_and_its_outage_counted(tmp_path):
    interval, failures, restart_s = 0.2, 3, 0.3
    supervisor, engines, watchdog, hung_at, step_start = asyncio.run(
        hang_and_recover(tmp_path, interval, failures, restart_s))
    halted = next(t for what, _, t in engines.calls if what == "halt")
    found = halted - hung_at
    # Found between N and N + 1 intervals after its last answer (the hang came within an interval of it);
    # the stack dump comes first, before its server is killed.
    assert failures * interval - interval <= found <= (failures + 1) * interval + 0.15, found
    assert [phase for phase, _ in watchdog.dumps] == ["engine 0 hung"] and watchdog.dumps[0][1] <= halted
    metrics = supervisor.metrics(step_start)
    assert metrics["fault/engine_restarts_total"] == 1
    assert metrics["fault/recovery_seconds"] == pytest.approx(restart_s, abs=0.15)
    assert found + restart_s - 0.05 <= metrics["fault/outage_seconds"] <= found + restart_s + interval + 0.2
    assert metrics["time/engine_outage_s"] == pytest.approx(metrics["fault/outage_seconds"], abs=0.05)
    assert "fault/outage_seconds" not in supervisor.metrics(step_start)  # read once
    assert undocumented([metrics]) == []


def test_an_engine_that_cannot_be_restarted_stops_the_run_naming_it_its_log_and_what_to_do(tmp_path):
    _, _, watchdog, _, _ = asyncio.run(hang_and_recover(tmp_path, fail_restart=True))
    [failure] = watchdog.failures
    message = str(failure)
    assert isinstance(failure, RunFailure) and failure.dead == ("engine-0",)
    assert message.startswith("run stopped: engine 0 (http://127.0.0.1:") and "could not be restarted: " \
        "RuntimeError (no message)" in message, message
    assert f"its log: {tmp_path / 'logs' / 'engine-0.log'}" in message
    assert "3 /health polls in a row went unanswered within 0.2 s each (fault.health_interval_s)" in message
    assert "fault.tolerate_engines = false" in message


def test_outages_count_each_second_of_a_step_once():
    outages = Outages()
    outages.begin(0, 10.0)
    outages.begin(1, 12.0)
    assert outages.within(8.0, 14.0) == 4.0  # engine 0 out from 10, engine 1 from 12: 4 s with one out
    outages.end(0, 13.0)
    outages.end(1, 15.0)
    assert outages.within(14.0, 20.0) == 1.0
    assert outages.within(20.0, 30.0) == 0.0


def test_the_report_draws_an_outage_as_engine_outage_not_other(tmp_path):
    rows = [{"step": 1, "time": 1.0, "perf/step_time_s": 1.0, "time/rollout_s": 0.5, "time/train_s": 0.3,
             "sync/seconds": 0.1},
            {"step": 2, "time": 26.0, "perf/step_time_s": 25.4, "time/rollout_s": 0.5, "time/train_s": 0.3,
             "sync/seconds": 0.1, "time/engine_outage_s": 24.0, "fault/outage_seconds": 24.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parts = time_breakdown(load_run(tmp_path))
    assert parts["engine outage"][2] == pytest.approx(24.0)
    assert parts["other"][2] == pytest.approx(0.5) and parts["other"][1] == pytest.approx(0.1)
    assert sum(p.get(2, 0.0) for label, p in parts.items() if label != "eval") == pytest.approx(25.4)


@pytest.mark.slow
def test_a_sigstopped_engine_is_found_within_the_bound_and_its_outage_accounted(ray_session, tiny_model_dir,
                                                                                addition_data_dir, tmp_path):
    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--rollout.num-rollouts", "8")
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    pid = run.pid_of("engine 1 ")
    signal_quietly(pid, signal.SIGSTOP)
    try:
        summary = run.result()
    finally:
        signal_quietly(pid, signal.SIGCONT)
    assert summary["train/steps"] == 8
    records = read_metrics(run.run_dir)
    [row] = [r for r in records if "fault/outage_seconds" in r]
    found = row["fault/outage_seconds"] - row["fault/recovery_seconds"]  # the last answer to the restart's start
    bound = (cfg.fault.health_failures + 1) * cfg.fault.health_interval_s
    assert found <= bound + 2.0, (found, bound)  # and the stack dump, about a second
    assert sum(r.get("time/engine_outage_s", 0.0) for r in records) == pytest.approx(row["fault/outage_seconds"],
                                                                                     abs=0.5)
    dumps = list((run.run_dir / "stacks").glob("*-engine-1-hung"))
    assert dumps and any(dumps[0].glob("driver-*.txt")), dumps
    assert "engine outage" in time_breakdown(load_run(run.run_dir))
    assert undocumented(records) == []
