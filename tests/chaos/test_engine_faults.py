"""Engines killed or stopped during an RL run (tiny model, two engines behind the router): restarted in place
with each weight transport, or, without restarts, the run never hangs silently and the error names the
engine, how it ended, and its log."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.runs import BackgroundRun, signal_quietly
from tests.e2e.test_rl_schedules import rl_config
from tests.metrics_doc import undocumented
from verst.monitor import read_metrics
from verst.orchestration.watchdog import RunFailure, StuckError

PLACEMENT = {"disk": "disaggregated", "distributed": "disaggregated", "tensor": "colocated"}


def two_engine_config(tmp_path, model_dir, data_dir, *overrides, transport="disk", schedule="sync"):
    return rl_config(tmp_path, model_dir, data_dir, "--schedule", schedule, "--cluster.placement", PLACEMENT[transport],
                     "--cluster.num-engines", "2", "--sync.transport", transport, "--rollout.num-rollouts", "6",
                     *overrides)


def test_a_killed_engine_stops_the_run_naming_it_and_its_log(ray_session, tiny_model_dir, addition_data_dir,
                                                             tmp_path):
    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.tolerate-engines", "false")
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    signal_quietly(run.pid_of("engine 1 "), signal.SIGKILL)
    with pytest.raises(RunFailure) as caught:
        run.result()
    message = str(caught.value)
    assert "engine 1 (http://127.0.0.1:" in message and "killed by SIGKILL" in message, message
    assert f"log {run.run_dir / 'logs' / 'engine-1.log'}" in message, message
    assert len(message.splitlines()) <= 40  # one screen
    assert (run.run_dir / "summary.json").exists() and (run.run_dir / "report.html").exists()
    logs = {entry["name"]: entry["log"] for entry in json.loads((run.run_dir / "processes.json").read_text())}
    for name, log in logs.items():  # every log in the run directory, which outlives the run's temporary one
        assert log is not None and log.startswith(str(run.run_dir / "logs")) and Path(log).exists(), (name, log)


@pytest.mark.slow
def test_a_stopped_engine_ends_the_run_with_the_stuck_phase_and_a_stack_dump(ray_session, tiny_model_dir,
                                                                             addition_data_dir, tmp_path):
    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.tolerate-engines", "false",
                            "--fault.rollout-timeout-s", "15", "--fault.sync-timeout-s", "15",
                            "--fault.engine-call-timeout-s", "10", "--fault.eval-timeout-s", "15")
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    pid = run.pid_of("engine 1 ")
    signal_quietly(pid, signal.SIGSTOP)
    try:
        with pytest.raises(StuckError) as caught:
            run.result()
    finally:
        signal_quietly(pid, signal.SIGCONT)
    message, dump = str(caught.value), caught.value.dump_dir
    assert "made no progress within" in message and "fault." in message, message
    assert "engine 1 (http://127.0.0.1:" in message and f"pid {pid}: stopped" in message, message
    assert str(dump) in message and dump.parent == run.run_dir / "stacks"
    driver = next(dump.glob("driver-*.txt")).read_text()
    assert "Thread" in driver and "File" in driver
    ranks = list(dump.glob("trainer-0-*.txt"))
    assert ranks and "File" in ranks[0].read_text()  # a rank's stacks, printed by its armed handler


@pytest.mark.parametrize("transport, schedule", [
    ("disk", "sync"),
    pytest.param("distributed", "sync", marks=pytest.mark.slow),
    pytest.param("distributed", "one_step_off", marks=pytest.mark.slow),  # the trainer is often a step ahead
    pytest.param("tensor", "sync", marks=pytest.mark.slow),
])
def test_a_killed_engine_is_restarted_and_the_run_finishes(ray_session, tiny_model_dir, addition_data_dir, tmp_path,
                                                           transport, schedule):
    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.health-interval-s", "0.5",
                            transport=transport, schedule=schedule)
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    signal_quietly(run.pid_of("engine 1 "), signal.SIGKILL)  # during the next rollout step
    summary = run.result()
    assert summary["train/steps"] == 6
    records = read_metrics(run.run_dir)
    restarts = [r for r in records if "fault/engine_restarts_total" in r]
    assert restarts and restarts[-1]["fault/engine_restarts_total"] == 1
    assert [r["fault/recovery_seconds"] for r in records if "fault/recovery_seconds" in r][0] > 0
    train = [r for r in records if "train/loss" in r]
    assert [r["sync/version"] for r in train] == list(range(1, 7))  # every push reached both engines
    assert undocumented(records) == []


@pytest.mark.parametrize("transport", ["distributed", pytest.param("disk", marks=pytest.mark.slow)])
def test_a_killed_engine_of_a_lora_run_is_restarted_on_the_base_with_the_adapter(ray_session, tiny_model_dir,
                                                                                 addition_data_dir, tmp_path, transport):
    """Every request of a LoRA run names its adapter: the restarted engine loads the base, then the adapter
    (the trainer's export, or the disk snapshot), so the run's requests keep being served."""
    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.health-interval-s", "0.5",
                            "--lora.enabled", "true", "--lora.rank", "4", transport=transport)
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    signal_quietly(run.pid_of("engine 1 "), signal.SIGKILL)
    assert run.result()["train/steps"] == 6
    records = read_metrics(run.run_dir)
    assert [r["fault/engine_restarts_total"] for r in records if "fault/engine_restarts_total" in r][-1] == 1
    assert [r["sync/version"] for r in records if "train/loss" in r] == list(range(1, 7))


def test_a_killed_engine_of_a_multi_lora_run_is_restarted_with_every_adapter(ray_session, tiny_model_dir,
                                                                              addition_data_dir, tmp_path):
    """Two adapters, each with its own rollout manager and router in front of the two engines: the restarted
    engine loads the base, then both adapters, and rejoins both routers; both adapters finish their steps."""
    from verst.config import VerstConfig

    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.health-interval-s", "0.5",
                            "--lora.enabled", "true", "--lora.rank", "4", "--rollout.num-rollouts", "5",
                            transport="distributed")
    tree = cfg.model_dump()
    tree["lora"]["adapters"] = [{"name": "add"}, {"name": "more", "rank": 2}]
    run = BackgroundRun(VerstConfig.model_validate(tree))
    deadline = time.monotonic() + 180
    while not (run.run_dir / "metrics.jsonl").exists() or not any(
            "lora/add/train/loss" in r for r in read_metrics(run.run_dir)):  # add's first step
        assert time.monotonic() < deadline and run.thread.is_alive(), run.error
        time.sleep(0.2)
    signal_quietly(run.pid_of("engine 1 "), signal.SIGKILL)
    summary = run.result()
    assert summary["train/steps"] == 10 and summary["lora/add/train/steps"] == summary["lora/more/train/steps"] == 5
    records = read_metrics(run.run_dir)
    assert [r["fault/engine_restarts_total"] for r in records if "fault/engine_restarts_total" in r][-1] == 1
    trained = [r for r in records if any(k.endswith("train/loss") for k in r)]
    assert [r["step"] for r in trained] == list(range(1, 11))
    assert all(r[k] == r["step"] for r in trained for k in r if k.endswith("sync/version"))  # every push landed


@pytest.mark.slow
def test_an_engine_killed_during_a_weight_sync_is_restarted_and_the_push_repeated(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path, monkeypatch):
    from verst.orchestration.weight_sync import TrainerWeightSync

    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.health-interval-s", "0.5")
    push, killed = TrainerWeightSync.sync, []

    async def push_after_a_kill(self, version):
        if version == 2 and not killed:  # the engines' health was checked just before: it dies mid-push
            killed.append(run.pid_of("engine 1 "))
            signal_quietly(killed[0], signal.SIGKILL)
        return await push(self, version)

    monkeypatch.setattr(TrainerWeightSync, "sync", push_after_a_kill)
    run = BackgroundRun(cfg)
    summary = run.result()
    assert killed and summary["train/steps"] == 6
    records = read_metrics(run.run_dir)
    assert max(r.get("fault/engine_restarts_total", 0) for r in records) == 1
    assert [r["sync/version"] for r in records if "train/loss" in r] == list(range(1, 7))


@pytest.mark.slow
def test_a_hung_engine_is_restarted_and_the_run_finishes(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    cfg = two_engine_config(tmp_path, tiny_model_dir, addition_data_dir, "--fault.health-interval-s", "0.5")
    run = BackgroundRun(cfg)
    run.wait_for_step(1)
    pid = run.pid_of("engine 1 ")
    signal_quietly(pid, signal.SIGSTOP)
    try:
        summary = run.result()
    finally:
        signal_quietly(pid, signal.SIGCONT)
    assert summary["train/steps"] == 6
    records = read_metrics(run.run_dir)
    assert max(r.get("fault/engine_restarts_total", 0) for r in records) == 1
    assert [r["sync/version"] for r in records if "train/loss" in r] == list(range(1, 7))
