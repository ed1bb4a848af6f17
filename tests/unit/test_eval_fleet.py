"""The evaluation fleet (`eval.num_engines`) against a stand-in engine on 127.0.0.1: each point's snapshot is
loaded as its step, a point whose engine reports another version is skipped as `pin_violation` before any
request is sent, and training goes on; the config and the placement refuse what cannot work, by field."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request

from tests.metrics_doc import undocumented
from tests.run_harness import harness_run, train_step
from tests.unit.test_cluster_placement import node
from verst.config import ConfigError, load_config
from verst.eval.backend import SNAPSHOTS_DIR
from verst.eval.fleet import EvalFleet
from verst.orchestration.capacity import PlacementRefused, check_fits
from verst.orchestration.placement import plan_bundles
from verst.run.rl_run import RLRun


def stand_in_engine(eos: int, stale_at: set[str], seen: dict) -> FastAPI:
    """An engine that loads any snapshot as the version it is told, except for the versions in `stale_at`,
    which it ignores (it goes on serving and reporting the weights it had); every reply is `[eos]`."""
    app = FastAPI()
    seen.update(version="0", loads=[], generated=[])

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> dict:
        body = await request.json()
        seen["loads"].append((body["model_path"], body["weight_version"]))
        if body["weight_version"] not in stale_at:
            seen["version"] = body["weight_version"]
        return {"success": True, "weight_version": seen["version"]}

    @app.get("/model_info")
    async def version() -> dict:
        return {"weight_version": seen["version"]}

    @app.post("/generate")
    async def generate(request: Request) -> dict:
        seen["generated"].append(seen["version"])
        return {"text": "", "output_ids": [eos], "meta_info": {
            "id": "r", "finish_reason": {"type": "stop"}, "prompt_tokens": 1, "completion_tokens": 1,
            "weight_version": seen["version"]}}

    return app


def serve(app: FastAPI, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    """`app` on the bound socket `sock`, in a thread, once it answers."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in engine did not start"
        time.sleep(0.02)
    return server, thread


def bound_socket() -> socket.socket:
    """A free port of 127.0.0.1, held: nothing answers there until something serves on it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def eos_of(model_dir) -> int:
    from verst.models import load_tokenizer

    return load_tokenizer(str(model_dir)).eos_token_id


@pytest.fixture
def engine(tiny_model_dir):
    """(url, what the stand-in saw); it ignores the load of version 1."""
    seen: dict = {}
    sock = bound_socket()
    server, thread = serve(stand_in_engine(eos_of(tiny_model_dir), {"1"}, seen), sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        server.should_exit = True
        thread.join(10)


def fleet_run(tmp_path, model_dir, data_dir) -> RLRun:
    """A stand-in run scoring with an evaluation fleet (`run.evaluator.fleet`, set once the fleet is open)."""
    return harness_run(tmp_path, "--eval.num-engines", "1", "--eval.max-prompts", "4", "--eval.keep-snapshots", "1",
                       "--model.path", str(model_dir), "--data.test-path", str(data_dir / "test.jsonl"),
                       "--data.apply-chat-template", "false")


def test_a_fleet_engine_reporting_another_version_is_skipped_and_training_goes_on(
        engine, tmp_path, tiny_model_dir, addition_data_dir):
    url, seen = engine
    trained = []
    run = fleet_run(tmp_path, tiny_model_dir, addition_data_dir)

    async def loop():
        async with EvalFleet(run.cfg, [url]) as fleet:
            run.evaluator.fleet = fleet
            await run.begin()
            for _ in range(2):
                await train_step(run)
                trained.append(run.version)
                await run.evaluator.start(run.version)
            await run.evaluator.finish(run.version)

    asyncio.run(asyncio.wait_for(loop(), 60))
    evals = {step: m for step, m in run.monitor.logger.rows if any(k.startswith("eval/") for k in m)}
    assert trained == [1, 2] and sorted(evals) == [0, 1, 2]
    snapshots = tmp_path / "run" / SNAPSHOTS_DIR
    assert seen["loads"] == [(str(tiny_model_dir), "0"), (str(snapshots / "step_00000001"), "1"),
                             (str(snapshots / "step_00000002"), "2")]
    assert evals[1]["eval/skipped_pin_violation"] == 1 and "eval/accuracy" not in evals[1]
    assert seen["generated"] == ["0"] * 4 + ["2"] * 4  # the point of step 1 sent no request
    for step in (0, 2):
        assert evals[step]["eval/weight_version"] == step and evals[step]["eval/n_prompts"] == 4
        assert evals[step]["eval/fleet_restarts"] == 0 and evals[step]["eval/fleet_load_seconds"] > 0
        assert 0 <= evals[step]["eval/lag_steps"] <= 2 - step and evals[step]["eval/duration_seconds"] > 0
    assert [step for step, _ in run.evaluator.history] == [0, 2]
    assert [p.name for p in snapshots.iterdir()] == ["step_00000002"]  # eval.keep_snapshots = 1
    assert undocumented(list(evals.values())) == []


def test_an_engine_that_does_not_answer_is_skipped_as_unhealthy(tmp_path, tiny_model_dir, addition_data_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nothing listens there once closed
    run = fleet_run(tmp_path, tiny_model_dir, addition_data_dir)

    async def loop():
        async with EvalFleet(run.cfg, [gone]) as fleet:  # no actor group: nothing to restart
            run.evaluator.fleet = fleet
            await run.begin()
            await train_step(run)
            await run.evaluator.finish(run.version)

    asyncio.run(asyncio.wait_for(loop(), 60))
    assert [(step, m.get("eval/skipped_unhealthy")) for step, m in run.monitor.logger.rows] == [(0, 1.0), (1, 1.0)]


def test_an_engine_that_stopped_answering_is_restarted_serving_the_snapshot(
        tmp_path, tiny_model_dir, addition_data_dir):
    sock, seen, servers = bound_socket(), {}, []

    class Engines:  # the actor group: a restart serves the snapshot as the version, at the same URL
        restarts: list = []

        def restart(self, index, model, version):
            self.restarts.append((index, model, version))
            app = stand_in_engine(eos_of(tiny_model_dir), set(), seen)
            seen["version"] = str(version)
            servers.append(serve(app, sock))

    run = fleet_run(tmp_path, tiny_model_dir, addition_data_dir)

    async def loop():
        async with EvalFleet(run.cfg, [f"http://127.0.0.1:{sock.getsockname()[1]}"], engines=Engines()) as fleet:
            run.evaluator.fleet = fleet
            await train_step(run)
            await run.evaluator.start(run.version)
            await run.evaluator.settle()

    try:
        asyncio.run(asyncio.wait_for(loop(), 60))
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(10)
    [(step, metrics)] = run.monitor.logger.rows
    snapshot = str(tmp_path / "run" / SNAPSHOTS_DIR / "step_00000001")
    assert step == 1 and Engines.restarts == [(0, snapshot, 1)] and seen["loads"] == []
    assert metrics["eval/fleet_restarts"] == 1 and metrics["eval/weight_version"] == 1
    assert seen["generated"] == ["1"] * 4


def test_a_fleet_with_a_backend_is_refused_by_field():
    with pytest.raises(ConfigError, match=r"eval.num_engines = 1 with eval.backend = 'm:f'"):
        load_config(None, ["--eval.num-engines", "1", "--eval.backend", "m:f"])


def test_evaluation_engines_get_bundles_of_their_own_counted_by_the_capacity_check():
    plan = plan_bundles("colocated", 1, 1, "cpu", teacher_engines=1, eval_engines=2)
    assert plan.teacher_bundles == [1] and plan.eval_bundles == [2, 3] and plan.share("eval", 1) == 1.0
    check_fits(plan, [node("a", cpus=2.0, slots=4.0)])
    with pytest.raises(PlacementRefused, match=r"need 4 bundles .* lower cluster.trainer_ranks / "
                                               r"cluster.num_engines / teacher.num_engines / eval.num_engines"):
        check_fits(plan, [node("a", cpus=2.0, slots=3.0)])
