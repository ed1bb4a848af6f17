"""A stand-in OpenEnv environment, written with openenv-core's own API: an arithmetic problem the agent
answers in up to MAX_ATTEMPTS steps (reward 1.0 for the right answer), served over OpenEnv's WebSocket
protocol by `serve()` on a free 127.0.0.1 port, and its typed `EnvClient`.

Any OpenEnv environment (a Docker image, a Hugging Face Space) takes its place: point `OpenEnvAgent`'s
`connect` at its client instead.
"""

from __future__ import annotations

import random
import re
import threading
from typing import Any

import uvicorn
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from starlette.websockets import WebSocketDisconnect

from verst.engine.server import listening_socket
from verst.inference_client.ports import wait_healthy

MAX_ATTEMPTS = 3


class AnswerAction(Action):
    answer: str


class ProblemObservation(Observation):
    problem: str
    feedback: str = ""


class ArithmeticEnv(Environment[AnswerAction, ProblemObservation, State]):
    """`reset(seed=...)` draws `a + b`; a step with the right number (the last one in the answer) ends
    the episode with reward 1.0, a wrong one is told so, and the MAX_ATTEMPTS-th wrong one ends it with 0.0."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session, no shared state

    def __init__(self) -> None:
        super().__init__()
        self._state, self._sum, self._problem = State(), 0, ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> ProblemObservation:
        rng = random.Random(seed)
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        self._state, self._sum, self._problem = State(episode_id=episode_id), a + b, f"What is {a} + {b}?"
        return ProblemObservation(problem=self._problem, feedback="Answer with a number.")

    def step(self, action: AnswerAction, timeout_s: float | None = None, **kwargs: Any) -> ProblemObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.answer)
        if numbers and int(numbers[-1]) == self._sum:
            return ProblemObservation(problem=self._problem, feedback="Correct.", done=True, reward=1.0)
        last = self._state.step_count >= MAX_ATTEMPTS
        return ProblemObservation(problem=self._problem, feedback="Wrong." if last else "Wrong, try again.",
                                  done=last, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class ArithmeticEnvClient(EnvClient[AnswerAction, ProblemObservation, State]):
    def _step_payload(self, action: AnswerAction) -> dict[str, Any]:
        return action.model_dump(exclude={"metadata"})

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[ProblemObservation]:
        observation = ProblemObservation(**payload["observation"], done=payload["done"], reward=payload["reward"])
        return StepResult(observation=observation, reward=payload["reward"], done=payload["done"])

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def serve(max_concurrent_envs: int = 64) -> tuple[str, uvicorn.Server]:
    """Serve ArithmeticEnv with OpenEnv's FastAPI app in a daemon thread; returns (its URL, the server)."""
    app = create_fastapi_app(ArithmeticEnv, AnswerAction, ProblemObservation, max_concurrent_envs=max_concurrent_envs)

    async def closed_quietly(scope: dict, receive: Any, send: Any) -> None:
        # openenv-core's WebSocket endpoint closes the socket once more after the client closed it at the end
        # of its episode; that second close raises, and is no error of the episode
        try:
            await app(scope, receive, send)
        except WebSocketDisconnect:
            if scope["type"] != "websocket":
                raise

    sock = listening_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(closed_quietly, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="openenv-arithmetic").start()
    wait_healthy(url, 30.0)
    return url, server
