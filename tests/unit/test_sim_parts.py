"""The simulation's bookkeeping: the ledger that accounts for every served group, the fault plan, the settings a
simulated run refuses, and the config it makes; the weight-sync process's errors; the scale window's bounds."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from verst.config import ConfigError, SyncConfig, load_config
from verst.run.rl_run import TrainerVersion
from verst.sim.accounting import Ledger
from verst.sim.config import SimConfig
from verst.sim.faults import fault_plan
from verst.sim.run import ScaleRecorder
from verst.sim.setup import simulated_config
from verst.sim.syncer_process import SyncerProcess
from verst.types import Sample


def group(index):
    return [Sample(group_index=index, index=index * 2 + i, metadata={"data_index": index}) for i in range(2)]


def test_the_ledger_accounts_for_every_group_and_names_what_does_not_add_up():
    ledger = Ledger()
    ledger.serve([group(i) for i in range(6)])
    ledger.train([group(0), group(1)])
    ledger.discard(group(2), "filtered")
    ledger.discard(group(3), "stale")
    ledger.give_back(group(4))  # its prompt served again
    report = ledger.report(queued=[], dropped_in_steps=0, unfinished=1)  # group 5 was generating at the end
    assert report["problems"] == []
    assert (report["trained"], report["discarded"], report["returned"]) == (2, {"filtered": 1, "stale": 1}, 1)
    ledger.train([group(1)])
    assert ledger.report(queued=[], dropped_in_steps=0, unfinished=1)["problems"] == [
        "groups trained more than once: [1]"]
    lost = Ledger()
    lost.serve([group(0), group(1)])
    lost.train([group(0)])
    assert "1 served groups are neither trained" in lost.report(queued=[], dropped_in_steps=0, unfinished=0)[
        "problems"][0]


def test_the_fault_plan_is_disjoint_and_the_same_every_run():
    sim = SimConfig(kill_fraction=0.05, stall_fraction=0.01, slow_fraction=0.02)
    plan = fault_plan(sim, 1024)
    assert {kind: len(engines) for kind, engines in plan.items()} == {"die": 51, "stall": 10, "slow": 20,
                                                                      "refuse_loads": 0}
    chosen = [e for engines in plan.values() for e in engines]
    assert len(chosen) == len(set(chosen)) and plan == fault_plan(sim, 1024)


def test_a_simulated_run_refuses_the_parts_it_does_not_simulate_by_field(registries_restored):
    for overrides, field in ((["--lora.enabled", "true"], "lora.enabled"),
                             (["--sync.check-weights", "true"], "sync.check_weights"),
                             (["--buffer.path", "m:f"], "buffer.path"),
                             (["--sandbox.provider", "local", "--rollout.generate-fn", "verst.rollout.agentic:generate",
                               "--rollout.agent-fn", "examples.coding.agent:run"], "sandbox.provider")):
        with pytest.raises(ConfigError, match=field):
            simulated_config(load_config(None, overrides), SimConfig())


def test_a_parameter_width_other_than_a_dtype_is_refused_by_field():
    with pytest.raises(ValueError, match=r"sim.bytes_per_param = 3 is not 1, 2 or 4"):
        SimConfig(bytes_per_param=3)
    assert SimConfig(bytes_per_param=1).model().weight_bytes == SimConfig().total_params


def test_the_simulated_config_names_the_simulated_parts(tmp_path, registries_restored):
    cfg = simulated_config(load_config(None, ["--run-dir", str(tmp_path / "run"), "--schedule", "fully_async"]),
                           SimConfig(agent_turns=3))
    assert (cfg.cluster.engine, cfg.sync.transport) == ("sim", "sim")
    assert cfg.plugins == ["verst.sim.plugin"]
    assert cfg.data.train_path == str(tmp_path / "run" / "sim_data" / "train.jsonl")
    assert (cfg.rollout.generate_fn, cfg.rollout.agent_fn) == ("verst.rollout.agentic:generate",
                                                              "verst.sim.workload:agent")
    assert cfg.buffer.path == "verst.sim.accounting:AccountedBuffer"


def test_the_weight_sync_process_raises_what_opening_it_raised_and_names_its_death():
    # without the simulation's plug-in the child knows no 'sim' transport: its error comes back here
    with pytest.raises(ValueError, match="sync.transport.*'sim'"):
        SyncerProcess(SyncConfig.model_construct(transport="sim", bucket_bytes=2**20), ["http://127.0.0.1:9"], {}, [])
    syncer = SyncerProcess(SyncConfig.model_construct(transport="sim", bucket_bytes=2**20), ["http://127.0.0.1:9"],
                           {}, ["verst.sim.plugin"])
    syncer.process.kill()
    syncer.process.join()
    with pytest.raises(RuntimeError, match=rf"weight-sync process \(pid {syncer.pid}\) died: exit code -9"):
        syncer.sync([], 1, first=False, reconnect=False)
    syncer.close()


def test_the_scale_window_closes_at_the_last_train_step_before_the_engines_run_out_of_work(tmp_path,
                                                                                          registries_restored):
    """What the engines do after the last step (the final evaluation, the worker's stop) is not counted: the
    busy share is read inside the trainer's last step."""
    cfg = simulated_config(load_config(None, ["--run-dir", str(tmp_path / "run"), "--schedule", "fully_async",
                                              "--rollout.num-rollouts", "4"]), SimConfig(warmup_steps=1))
    counters = {"index": 0, "busy_seconds": 0.0, "uptime_seconds": 0.0, "paused_seconds": 0.0, "batch_seconds": 0.0,
                "finished": 0}
    engines = SimpleNamespace(stats=lambda: [dict(counters)], pids=[])
    manager = SimpleNamespace(thread_id=threading.get_native_id(), pids={})
    trainer = SimpleNamespace(weight_sync=None, step_seconds=[])
    recorder = ScaleRecorder(cfg, SimConfig(warmup_steps=1), engines, manager, trainer)
    faults, supervisor = SimpleNamespace(summary=dict), SimpleNamespace(restarts=0)
    version = TrainerVersion()
    rl_run = SimpleNamespace(version=version.value, watch_version=version.watchers.append)

    def work(seconds: float, busy: float) -> None:
        counters["uptime_seconds"] += seconds
        counters["busy_seconds"] += busy

    async def run() -> None:
        async with recorder.window(rl_run):
            work(10.0, 5.0)  # warm-up: outside
            version.advance()  # the window opens inside step 1, with no await between
            work(10.0, 9.0)  # steps 2..4
            for _ in range(3):
                version.advance()  # and closes inside step 4, before the final evaluation starts
            work(10.0, 0.0)  # the final evaluation: engines idle
            recorder.end(faults, supervisor)

    asyncio.run(run())
    assert recorder.result["engines"]["busy_fraction"] == pytest.approx(0.9)
    assert recorder.result["engines"]["engine_seconds"] == pytest.approx(10.0)
