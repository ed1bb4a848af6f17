"""One NeMo Gym episode, run by `verst.connectors.nemo_gym` in NeMo Gym's own Python (>= 3.12) environment:
reads a job from stdin, writes the agent's verify response as JSON to the file named by argv[1].

The job names a resources server (`module:Class`, with its config), the agent (NeMo Gym's `simple_agent`
unless named) and the task row. The three servers run in this process on free 127.0.0.1 ports, in one
event loop; the policy model is NeMo Gym's `vllm_model` server (Responses API -> Chat Completions) with
its base URL set to the episode's session on verst's session server. Imports nothing from verst.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import socket
import sys
from typing import Any

AGENT = "responses_api_agents.simple_agent.app:SimpleAgent"
MODEL = "responses_api_models.vllm_model.app:VLLMModel"
RESOURCES, POLICY, AGENT_NAME = "resources", "policy_model", "agent"


def _import(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _global_config(job: dict[str, Any], ports: dict[str, int]) -> dict[str, Any]:
    """NeMo Gym's global config: each server under `{name: {server type: {instance: config}}}`."""
    where = {name: {"host": "127.0.0.1", "port": port, "entrypoint": "app.py"} for name, port in ports.items()}
    model = {**where[POLICY], "base_url": job["base_url"], "api_key": "unused", "model": job.get("model", "verst"),
             "return_token_id_information": False, "uses_reasoning_parser": False}
    agent = {**where[AGENT_NAME], **job.get("agent_config", {}),
             "resources_server": {"type": "resources_servers", "name": RESOURCES},
             "model_server": {"type": "responses_api_models", "name": POLICY}}
    return {
        "head_server": {"host": "127.0.0.1", "port": 0},
        RESOURCES: {"resources_servers": {RESOURCES: {**where[RESOURCES], **job.get("resources_config", {})}}},
        POLICY: {"responses_api_models": {"vllm_model": model}},
        AGENT_NAME: {"responses_api_agents": {"agent": agent}},
    }


async def run_episode(job: dict[str, Any]) -> dict[str, Any]:
    import uvicorn
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.server_utils import GlobalAIOHTTPAsyncClientConfig, ServerClient, request, set_global_aiohttp_client
    from omegaconf import OmegaConf

    classes = {RESOURCES: _import(job["resources_server"]), POLICY: _import(MODEL),
               AGENT_NAME: _import(job.get("agent", AGENT))}
    sockets = {name: _socket() for name in classes}
    cfg = _global_config(job, {name: s.getsockname()[1] for name, s in sockets.items()})
    set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
                          global_config_dict=OmegaConf.create(cfg))
    servers = []
    for name, cls in classes.items():
        instance_cfg = next(iter(next(iter(cfg[name].values())).values()))
        config_cls = cls.model_fields["config"].annotation
        server = cls(config=config_cls.model_validate({**instance_cfg, "name": name}), server_client=client)
        servers.append(uvicorn.Server(uvicorn.Config(server.setup_webserver(), log_level="warning")))
    tasks = [asyncio.create_task(s.serve(sockets=[sockets[name]])) for s, name in zip(servers, classes)]
    try:
        while not all(s.started for s in servers):
            if any(t.done() for t in tasks):
                raise RuntimeError("a NeMo Gym server stopped while starting")
            await asyncio.sleep(0.02)
        reply = await request("POST", f"http://127.0.0.1:{sockets[AGENT_NAME].getsockname()[1]}/run",
                              json=job["row"])
        body = await reply.read()
        if reply.status != 200:
            raise RuntimeError(f"NeMo Gym agent /run: {reply.status}: {body.decode()[:2000]}")
        return json.loads(body)
    finally:
        for s in servers:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> None:
    result = asyncio.run(run_episode(json.load(sys.stdin)))
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
