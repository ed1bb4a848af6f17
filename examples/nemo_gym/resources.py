"""A stand-in NeMo Gym resources server, written with nemo-gym's own API: an `add` tool, and verification
that rewards a final answer holding the row's `expected` sum. It runs in NeMo Gym's Python (>= 3.12)
environment, inside the episode process (verst/connectors/nemo_gym_episode.py), so it imports no verst.

Any NeMo Gym resources server takes its place: name it in `NemoGymAgent("module:Class")`.
"""

from __future__ import annotations

import re

from fastapi import FastAPI
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import BaseModel, ConfigDict


class AddRequest(BaseModel):
    a: int
    b: int


class AddResponse(BaseModel):
    sum: int


class AddVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")
    expected: int


class AddResourcesServer(SimpleResourcesServer):
    config: BaseResourcesServerConfig

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/add")(self.add)
        return app

    async def add(self, body: AddRequest) -> AddResponse:
        return AddResponse(sum=body.a + body.b)

    async def verify(self, body: AddVerifyRequest) -> BaseVerifyResponse:
        """1.0 when the last number of the agent's last message is the expected sum."""
        texts = [part.text for item in body.response.output if item.type == "message"
                 for part in item.content if part.type == "output_text"]
        numbers = re.findall(r"-?\d+", texts[-1]) if texts else []
        reward = float(bool(numbers) and int(numbers[-1]) == body.expected)
        return BaseVerifyResponse(**body.model_dump(), reward=reward)
