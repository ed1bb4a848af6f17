"""How an RL run is set up before any actor starts: the router in front of the engines, and the clock
that reports the start-up phases."""

from __future__ import annotations

import time

import pytest

from verst.config import load_config
from verst.eval.agentic import score_key
from verst.rollout.from_config import request_batch
from verst.run.setup import StartupClock, router_spec


@pytest.mark.parametrize("overrides, engines, expected", [
    ([], 1, None),  # one engine: called directly
    ([], 2, ("round_robin", "min_load")),
    (["--cluster.router", "always"], 1, ("round_robin", "min_load")),
    (["--rollout.agent-fn", "examples.calculator.agent:run"], 1, None),
    (["--rollout.agent-fn", "examples.calculator.agent:run"], 4, ("manual", "min_load")),  # session affinity
    (["--rollout.agent-fn", "examples.calculator.agent:run", "--cluster.router", "always"], 1, ("manual", "min_load")),
])
def test_router_only_in_front_of_several_engines_unless_asked(overrides, engines, expected):
    spec = router_spec(load_config(None, overrides), engines)
    assert (spec and (spec.policy, spec.assignment_mode)) == expected


def test_router_setting_is_checked_by_name():
    with pytest.raises(Exception, match="cluster.router"):
        load_config(None, ["--cluster.router", "never"])


def test_startup_clock_reports_each_phase_and_the_total():
    started = time.perf_counter()
    clock = StartupClock(started)
    time.sleep(0.02)
    clock.lap("ray")
    clock.lap("engines")
    metrics = clock.metrics()
    assert set(metrics) == {"time/startup/ray_s", "time/startup/engines_s", "time/startup_s"}
    assert metrics["time/startup/ray_s"] >= 0.02 and metrics["time/startup/engines_s"] < metrics["time/startup/ray_s"]
    assert metrics["time/startup_s"] == pytest.approx(metrics["time/startup/ray_s"] + metrics["time/startup/engines_s"])
    assert clock.summary().startswith(f"{metrics['time/startup_s']:.1f} s (ray ")


def test_requests_are_batched_only_straight_to_an_engine_and_agent_runs_score_success():
    cfg = load_config(None, ["--rollout.request-batch", "32"])
    assert request_batch(cfg, None) == 32 and request_batch(cfg, "http://127.0.0.1:9/") == 1
    assert score_key(cfg) == "eval/accuracy"
    assert score_key(load_config(None, ["--rollout.agent-fn", "examples.calculator.agent:run"])) == "eval/success"


def test_the_rollout_side_module_loads_without_the_trainer_stack():
    # The rollout manager actor unpickles build_rollout_parts while the engine and trainer processes start
    # on the same cores: its module must not pull in torch, FSDP2, the weight transports or Ray (the
    # tokenizer it loads later still brings torch in through transformers).
    import subprocess
    import sys

    code = ("import sys, verst.rollout.from_config; "
            "print(sorted(m for m in ('torch', 'ray', 'verst.trainer', 'verst.sync') if m in sys.modules))")
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "[]"


def test_the_driver_hands_the_ranks_objects_without_importing_torch():
    """The train step and the backend factory go to the ranks as functions (pickled by reference); their
    modules import torch only when called, so the driver of a run loads none."""
    import subprocess
    import sys

    code = ("import pickle, sys; from verst.schedules import sync, one_step_off, fully_async; from verst.run import rl_run, start, trainer_setup; "
            "from verst.trainer.rl_steps import train_rollout_step; from verst.trainer import fsdp2_backend; "
            "assert pickle.loads(pickle.dumps(train_rollout_step)) is train_rollout_step; "
            "assert pickle.loads(pickle.dumps(fsdp2_backend)) is fsdp2_backend; print('torch' in sys.modules)")
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def test_the_run_handles_offer_what_their_protocols_ask():
    """The run's parts take their handles typed by protocols; the Ray handles of an RL run (and the in-process
    rank) have every member those protocols name."""
    from verst.orchestration import EngineMemory, RolloutSource, WeightSyncHandle
    from verst.orchestration.cluster import RolloutManagerHandle
    from verst.orchestration.engine_actors import EngineActorGroup
    from verst.orchestration.trainer_actors import TrainerActorGroup
    from verst.orchestration.weight_sync import TrainerWeightSync
    from verst.trainer import InProcessRank, TrainerRanks

    def members(protocol):
        names = set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}
        return names - {"mro"}

    for protocol, handles in [(TrainerRanks, [TrainerActorGroup, InProcessRank]), (EngineMemory, [EngineActorGroup]),
                              (RolloutSource, [RolloutManagerHandle]), (WeightSyncHandle, [TrainerWeightSync])]:
        for handle in handles:
            # a member is a class attribute or one `__init__` sets
            missing = {n for n in members(protocol)
                       if not hasattr(handle, n) and n not in handle.__init__.__code__.co_names}
            assert not missing, (protocol.__name__, handle.__name__, missing)
