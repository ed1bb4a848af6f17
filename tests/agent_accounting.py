"""Token accounting of agent connectors: a transport that forwards /generate to a real engine and records
what the engine was sent and sampled, and the check that a trajectory trains on exactly those ids, with the
loss mask on the engine's output only."""

from __future__ import annotations

import dataclasses
import json

import httpx

from verst.types import Sample


@dataclasses.dataclass
class EngineCall:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


class RecordingTransport(httpx.AsyncBaseTransport):
    """Forward every request to the engine; record each unstreamed /generate's input and output ids."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.calls: list[EngineCall] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/generate":
            return response
        body = json.loads(request.content)
        assert not body.get("stream"), "the recording transport reads whole replies; an agent streamed"
        content = await response.aread()
        reply = json.loads(content)
        meta = reply["meta_info"]
        self.calls.append(EngineCall(list(body["input_ids"]), list(reply["output_ids"]),
                                     [float(t[0]) for t in meta.get("output_token_logprobs") or []]))
        return httpx.Response(response.status_code, headers=response.headers, content=content)

    async def aclose(self) -> None:
        await self.inner.aclose()


def assert_engine_tokens(sample: Sample, calls: list[EngineCall]) -> None:
    """`calls` (one episode's engine calls, in order) account for `sample` exactly: each call was sent the
    trajectory so far, its output ids follow in `sample.tokens` with loss mask 1 and the engine's logprobs,
    and every other token (prompt, environment, template) has loss mask 0."""
    assert calls, f"sample {sample.index}: the engine was never called"
    tokens, start = sample.tokens, len(sample.tokens) - sample.response_length
    expected_mask = [0] * len(tokens)
    for i, call in enumerate(calls):
        n_in, n_out = len(call.input_ids), len(call.output_ids)
        assert tokens[:n_in] == call.input_ids, f"engine call {i} was sent other ids than the trajectory's prefix"
        assert tokens[n_in:n_in + n_out] == call.output_ids, f"engine call {i}'s output ids are not the trained ids"
        assert sample.rollout_logprobs[n_in - start:n_in - start + n_out] == call.logprobs, f"call {i}: logprobs"
        expected_mask[n_in:n_in + n_out] = [1] * n_out
    assert expected_mask[:start] == [0] * start, "engine output inside the prompt"
    assert sample.loss_mask == expected_mask[start:], "the loss mask is not exactly the engine's output"
    assert len(calls[-1].input_ids) + len(calls[-1].output_ids) == len(tokens), "tokens after the last engine call"


def run_episodes(cfg, model_dir, prompts) -> list[tuple[Sample, list[EngineCall]]]:
    """Each prompt's episode (generate and reward, as a rollout runs it) against the tiny model behind an
    embedded engine, one at a time so that the recorded engine calls are that episode's."""
    import asyncio

    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.process import BackgroundServer
    from verst.inference_client.client import EngineClient
    from verst.models.loader import load_model_and_tokenizer
    from verst.rollout import RolloutContext, generate_and_reward

    model, tok = load_model_and_tokenizer(model_dir)
    recorder = RecordingTransport()

    async def main():
        done = []
        with BackgroundServer(EngineCore(model, tok, EngineConfig(max_running_requests=4))) as server:
            async with EngineClient(server.url, transport=recorder) as client:
                ctx = RolloutContext.from_config(cfg, client, tok, source=None)
                try:
                    for sample in prompts:
                        recorder.calls.clear()
                        done.append((await generate_and_reward(ctx, sample), list(recorder.calls)))
                finally:
                    await ctx.aclose()
        return done

    return asyncio.run(main())


def run_scripted_episodes(cfg, model_dir, script, prompts):
    """As `run_episodes`, against a scripted engine that replies with `script`'s turns (tool calls, answers
    a random tiny model would not write); its recorded calls are the engine's."""
    import asyncio

    from verst.inference_client.client import EngineClient
    from verst.models import load_tokenizer
    from verst.rollout import RolloutContext, generate_and_reward
    from verst.session.scripted import ScriptedEngine

    tok = load_tokenizer(model_dir)

    async def main():
        done = []
        for sample in prompts:
            engine = ScriptedEngine(tok, script)
            async with EngineClient("http://scripted-engine", transport=engine) as client:
                ctx = RolloutContext.from_config(cfg, client, tok, source=None)
                try:
                    done.append((await generate_and_reward(ctx, sample), list(engine.calls)))
                finally:
                    await ctx.aclose()
        return done

    return asyncio.run(main())
