"""The remote reward client against a real HTTP reward server on 127.0.0.1 (uvicorn + FastAPI, a thread)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from verst.config import RewardConfig
from verst.rewards import REWARD_ERROR_KEY, RemoteReward, RewardError, compute_rewards
from verst.types import Sample, Status

SLOW_REPLY_S = 1.0


def reward_app(seen: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request):
        body = await request.json()
        seen["bodies"].append(body)
        return {"reward": float(body["response"] == body["label"])}

    @app.post("/dict")
    async def dict_reward(request: Request):
        body = await request.json()
        return {"reward": {"correct": float(body["response"] == body["label"]), "length": len(body["response"])}}

    @app.post("/slow")
    async def slow():
        await asyncio.sleep(SLOW_REPLY_S)
        return {"reward": 1.0}

    @app.post("/fail")
    async def fail():
        return PlainTextResponse("judge crashed", status_code=500)

    @app.post("/not-json")
    async def not_json():
        return PlainTextResponse("reward=1")

    @app.post("/no-reward")
    async def no_reward():
        return {"score": 1.0}

    @app.post("/concurrency")
    async def concurrency():
        seen["in_flight"] += 1  # handlers share one event loop thread: no lock needed
        seen["max_in_flight"] = max(seen["max_in_flight"], seen["in_flight"])
        await asyncio.sleep(0.1)
        seen["in_flight"] -= 1
        return {"reward": 1.0}

    return app


@pytest.fixture(scope="module")
def server():
    """(base url, what the server saw); the server is stopped even when a test fails."""
    seen = {"bodies": [], "in_flight": 0, "max_in_flight": 0}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, held open so nobody else takes it
    config = uvicorn.Config(reward_app(seen), log_level="warning", timeout_graceful_shutdown=2)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("reward server did not start within 20 s")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def remote(url: str, **kwargs) -> RewardConfig:
    return RewardConfig(type="remote", url=url, **kwargs)


def test_scalar_rewards_and_the_request_body(server):
    url, seen = server
    samples = [
        Sample(index=0, prompt=[{"role": "user", "content": "1+2="}], response="3", label="3", metadata={"task": "t"}),
        Sample(index=1, prompt="1+2=", response="4", label="3"),
    ]
    metrics = asyncio.run(compute_rewards(samples, remote(f"{url}/score")))
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert metrics["rollout/reward_failures"] == 0.0 and metrics["rollout/reward_mean"] == 0.5
    assert {"prompt": [{"role": "user", "content": "1+2="}], "response": "3", "label": "3", "metadata": {"task": "t"}} in seen["bodies"]


def test_dict_rewards(server):
    url, _ = server
    samples = [Sample(index=0, response="abc", label="abc"), Sample(index=1, response="ab", label="abc")]
    metrics = asyncio.run(compute_rewards(samples, remote(f"{url}/dict", key="correct")))
    assert samples[0].reward == {"correct": 1.0, "length": 3.0}
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/reward/length"] == 2.5


def test_timeout_is_a_recorded_failure(server):
    url, _ = server
    samples = [Sample(index=3, response="x", label="x", status=Status.COMPLETED)]
    start = time.monotonic()
    metrics = asyncio.run(compute_rewards(samples, remote(f"{url}/slow", timeout_s=0.2)))
    assert time.monotonic() - start < SLOW_REPLY_S
    assert samples[0].status == Status.FAILED and samples[0].reward is None
    assert samples[0].metadata[REWARD_ERROR_KEY] == f"reward server {url}/slow: no reply within 0.2 s"
    assert metrics["rollout/reward_failures"] == 1.0


@pytest.mark.parametrize(
    "path, reason",
    [
        ("/fail", "HTTP 500: 'judge crashed'"),
        ("/not-json", "reply is not JSON"),
        ("/no-reward", "reply has no 'reward' key"),
    ],
)
def test_bad_replies_raise_reward_error(server, path, reason):
    url, _ = server
    fn = RemoteReward(f"{url}{path}", timeout_s=5)

    async def call():
        try:
            return await fn(Sample(response="x", label="x"))
        finally:
            await fn.aclose()

    with pytest.raises(RewardError, match=reason):
        asyncio.run(call())


def test_unreachable_server_raises_reward_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connections are refused
        samples = [Sample(response="x", label="x")]
        asyncio.run(compute_rewards(samples, remote(f"http://127.0.0.1:{port}/score", timeout_s=2)))
    assert samples[0].status == Status.FAILED and "ConnectError" in samples[0].metadata[REWARD_ERROR_KEY]


def test_concurrency_is_bounded(server):
    url, seen = server
    seen["max_in_flight"] = 0
    samples = [Sample(index=i, response="x", label="x") for i in range(12)]
    metrics = asyncio.run(compute_rewards(samples, remote(f"{url}/concurrency", max_concurrency=3)))
    assert metrics["rollout/reward_failures"] == 0.0
    assert seen["max_in_flight"] == 3  # never more than the limit, and the limit is actually used


def test_a_client_belongs_to_one_event_loop_until_closed(server):
    url, _ = server
    fn = RemoteReward(f"{url}/score", timeout_s=5, max_concurrency=2)

    async def step(close: bool) -> float:
        samples = [Sample(response="y", label="y")]
        await compute_rewards(samples, fn)
        if close:
            await fn.aclose()
        return samples[0].reward

    async def step_with_a_foreign_loop() -> None:
        await step(close=False)
        try:
            with pytest.raises(RuntimeError, match="bound to another event loop"):
                await asyncio.to_thread(asyncio.run, step(close=False))  # a second loop, in a thread
        finally:
            await fn.aclose()

    assert asyncio.run(step(close=True)) == 1.0
    assert asyncio.run(step(close=True)) == 1.0  # closed in its loop: usable from a new one
    asyncio.run(step_with_a_foreign_loop())
