"""The session server over loopback, driven by the official `openai` client: a real embedded engine (tiny
model, in this process) end to end; tool calls through a scripted engine at the HTTP edge (a random tiny
model never writes one); bad input, an unreachable engine and concurrent sessions; `verst serve session`."""

import asyncio
import json

import httpx
import openai
import pytest
import torch

from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer, EngineProcess
from verst.inference_client.client import EngineClient
from verst.models.loader import chat_prompt_ids, load_model_and_tokenizer
from verst.session.http import SessionServer
from verst.session.manager import SessionManager
from verst.session.scripted import ScriptedEngine
from verst.types import Sample, Status

torch.set_num_threads(1)
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}}}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
USER = {"role": "user", "content": "What is 1+2?"}
# a conversation resumed after the model asked for two additions: the tool results below answer these calls
ASKED = {"role": "assistant", "content": "Adding twice.", "tool_calls": [
    {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    for i in range(2)]}


def tool_turn(result: str) -> str:
    """The tiny template's tool turn, written out by hand: what the server must append after a reply."""
    return f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    with BackgroundServer(EngineCore(model, tokenizer, EngineConfig(max_running_requests=16))) as server:
        yield server, tokenizer


class RecordingClient(EngineClient):
    """The real engine client, keeping every request and reply so tests compare the sample with them."""

    def __init__(self, url, **kw):
        super().__init__(url, **kw)
        self.calls = []

    async def generate(self, input_ids=None, sampling_params=None, **kw):
        result = await super().generate(input_ids, sampling_params, **kw)
        self.calls.append((list(input_ids), kw.get("routing_key"), result))
        return result


def agent_client(server, session_id):
    return openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{session_id}/v1", api_key="unused", max_retries=0)


async def collect(server, session_id) -> Sample:
    async with httpx.AsyncClient(base_url=server.url) as http:
        reply = await http.post(f"/sessions/{session_id}/samples")
        assert reply.status_code == 200, reply.text
        (sample,) = reply.json()["samples"]
        assert (await http.delete(f"/sessions/{session_id}")).status_code == 204
        assert (await http.get(f"/sessions/{session_id}")).status_code == 404
    return Sample.from_dict(sample).validate()


def test_real_engine_multi_turn_tokens_are_the_sampled_ids_plus_the_tool_ids(served):
    engine, tok = served

    async def main():
        async with RecordingClient(engine.url) as client, SessionServer(SessionManager(client, tok)) as server:
            async with httpx.AsyncClient(base_url=server.url) as http:
                sid = (await http.post("/sessions", json={"metadata": {"task": "add"}})).json()["session_id"]
            oai = agent_client(server, sid)
            messages, replies = [USER, ASKED], []
            for turn, result in enumerate(["3", "7", None]):
                reply = await oai.chat.completions.create(model="tiny", messages=messages, tools=[ADD], max_tokens=6,
                                                          temperature=1.0, seed=turn, logprobs=True)
                replies.append(reply)
                messages.append(reply.choices[0].message)  # the client's own object, as agents pass it back
                if result is not None:
                    messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": result})
            return sid, replies, client.calls, await collect(server, sid)

    sid, replies, calls, sample = asyncio.run(main())
    assert [key for _, key, _ in calls] == [sid] * 3  # every engine request carries the session as routing key
    assert calls[0][0] == chat_prompt_ids(tok, [USER, ASKED], tools=[ADD])
    expected_mask, expected_logprobs = [], []
    for (sent, _, result), (next_sent, _, _), tool in zip(calls, calls[1:], ["3", "7"]):
        ended = result.output_ids[-1] == tok.eos_token_id
        glue = ("\n" if ended else "<|im_end|>\n") + tool_turn(tool)
        tool_ids = tok.encode(glue, add_special_tokens=False)
        assert next_sent == sent + result.output_ids + tool_ids  # exact ids; only the tool turn was tokenized
        expected_mask += [1] * len(result.output_ids) + [0] * len(tool_ids)
        expected_logprobs += result.logprobs + [0.0] * len(tool_ids)
    last = calls[-1][2]
    assert sample.tokens == calls[-1][0] + last.output_ids and sample.prompt_tokens == calls[0][0]
    assert sample.loss_mask == expected_mask + [1] * len(last.output_ids)
    assert sample.rollout_logprobs == expected_logprobs + last.logprobs
    assert sample.weight_versions == [r.weight_version for _, _, r in calls]
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.metadata["session_id"] == sid
    for reply, (_, _, result) in zip(replies, calls):  # what the agent saw is what the trainer gets
        assert [c.logprob for c in reply.choices[0].logprobs.content] == result.logprobs


def scripted_server(tok, script, **kw):
    engine = ScriptedEngine(tok, script, **kw)
    client = EngineClient("http://scripted-engine", transport=engine)
    return engine, client, SessionServer(SessionManager(client, tok))


async def tool_agent(server, session_id, stream_last=False):
    """A minimal tool-using agent on the official client: call tools until the model answers."""
    oai = agent_client(server, session_id)
    messages = [USER]
    while True:
        if stream_last and len(messages) > 1:
            stream = await oai.chat.completions.create(model="m", messages=messages, tools=[ADD], stream=True,
                                                       logprobs=True,
                                                       stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            return messages, chunks
        reply = await oai.chat.completions.create(model="m", messages=messages, tools=[ADD], logprobs=True)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return messages, reply
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})


def test_tool_calls_round_trip_through_the_openai_client(served):
    _, tok = served
    engine, client, server = scripted_server(tok, [CALL, "The sum is 3."])

    async def main():
        async with client, server:
            sid = server.manager.create()
            messages, final = await tool_agent(server, sid)
            return sid, messages, final, await collect(server, sid)

    sid, messages, final, sample = asyncio.run(main())
    call = messages[1].tool_calls[0]
    assert messages[1].content is None and (call.function.name, call.type) == ("add", "function")
    assert messages[2] == {"role": "tool", "tool_call_id": call.id, "content": "3"}
    assert final.choices[0].message.content == "The sum is 3." and final.choices[0].finish_reason == "stop"
    c0, c1 = engine.calls
    tool_ids = tok.encode("\n" + tool_turn("3"), add_special_tokens=False)
    assert c1.input_ids == c0.input_ids + c0.output_ids + tool_ids
    assert sample.tokens == c1.input_ids + c1.output_ids
    assert sample.loss_mask == [1] * len(c0.output_ids) + [0] * len(tool_ids) + [1] * len(c1.output_ids)
    assert sample.rollout_logprobs == c0.logprobs + [0.0] * len(tool_ids) + c1.logprobs
    assert sample.status is Status.COMPLETED and sample.metadata["tito_mismatch"] == []
    assert sample.response == "The sum is 3."


def test_stream_true_is_answered_token_by_token(served):
    _, tok = served
    engine, client, server = scripted_server(tok, [CALL, "The sum is 3."])

    async def main():
        async with client, server:
            sid = server.manager.create()
            return await tool_agent(server, sid, stream_last=True)

    _, chunks = asyncio.run(main())
    *content, usage = chunks
    assert len(content) == len(engine.calls[1].output_ids) + 1  # one chunk per output id, then the finish
    assert "".join(c.choices[0].delta.content or "" for c in content) == "The sum is 3."
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["stop"]
    logprobs = [e.logprob for c in content if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert logprobs == engine.calls[1].logprobs
    assert usage.choices == [] and usage.usage.completion_tokens == len(engine.calls[1].output_ids)


def test_bad_input_and_a_down_engine_fail_alone_among_concurrent_sessions(served):
    _, tok = served
    engine, client, server = scripted_server(tok, [CALL, "The sum is 3."], delay_s=0.05)

    async def expect_error(coro):
        try:
            await coro
        except openai.APIStatusError as exc:
            return exc.status_code, exc.message
        raise AssertionError("no error")

    async def main():
        async with client, server:
            good = [server.manager.create() for _ in range(4)]
            down, malformed = server.manager.create(), server.manager.create()
            engine.down.add(down)
            async with httpx.AsyncClient(base_url=server.url) as http:
                results = await asyncio.gather(
                    *(tool_agent(server, sid) for sid in good),
                    expect_error(agent_client(server, "no-such-session").chat.completions.create(
                        model="m", messages=[USER])),
                    expect_error(agent_client(server, malformed).chat.completions.create(
                        model="m", messages=[USER, {"role": "robot", "content": "hi"}])),
                    expect_error(agent_client(server, down).chat.completions.create(model="m", messages=[USER])),
                    http.post(f"/sessions/{malformed}/v1/chat/completions", content=b"{not json"),
                )
            samples = [await collect(server, sid) for sid in good]
            return good, results[4:], samples

    good, (unknown, bad, unreachable, bad_json), samples = asyncio.run(main())
    assert unknown[0] == 404 and "unknown session 'no-such-session'" in unknown[1]
    assert bad[0] == 400 and "messages[1].role = 'robot'" in bad[1]
    assert unreachable[0] == 502 and "ConnectError" in unreachable[1] and "is down" in unreachable[1]
    assert bad_json.status_code == 400 and "invalid JSON" in bad_json.json()["error"]["message"]
    for sid, sample in zip(good, samples):  # every other session got exactly its own turns
        mine = [c for c in engine.calls if c.routing_key == sid]
        assert len(mine) == 2 and sample.tokens == mine[1].input_ids + mine[1].output_ids
        assert sample.status is Status.COMPLETED and sample.response == "The sum is 3."


def test_verst_serve_session_runs_standalone(served, tiny_model_dir):
    engine, tok = served
    proc = EngineProcess(tiny_model_dir, entry=["-m", "verst.cli.main", "serve", "session"],
                         args=["--engine-url", engine.url, "--max-new-tokens", "4"])
    with proc, httpx.Client(base_url=proc.url, timeout=30) as http:
        sid = http.post("/sessions").json()["session_id"]
        reply = http.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": [USER], "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] <= 4
        view = http.get(f"/sessions/{sid}").json()
        assert view["n_prompt_tokens"] == len(chat_prompt_ids(tok, [USER])) and len(view["turns"]) == 1
        assert http.delete(f"/sessions/{sid}").status_code == 204
        assert http.get("/health").json() == {"status": "ok", "sessions": 0}


def test_real_engine_a_streamed_turn_goes_on_across_a_weight_update(served):
    """pause(abort) → new version → continue while a session turn streams, as the syncer does: with partial
    rollouts the turn is the first call's output followed by the continuation's, streamed as one growing output,
    each token with the version that sampled it."""
    engine, tok = served
    budget, streamed = 400, []

    async def main():
        async with EngineClient(engine.url) as client:
            m = SessionManager(client, tok, partial_rollout=True, default_sampling={"ignore_eos": True})
            sid = m.create()
            old = int(await client.get_weight_version())
            turn = asyncio.create_task(m.chat_completion(sid, {"messages": [USER], "max_tokens": budget},
                                                         on_tokens=streamed.append))
            while len(streamed) < 5:  # some tokens decoded on the old weights
                await asyncio.sleep(0.01)
            await client.pause("abort")
            await client.update_weight_version(str(old + 1))
            await client.continue_generation()
            return old, await turn, m.get(sid), m.samples(sid)[0]

    old, reply, view, sample = asyncio.run(main())
    n = sample.token_versions.count(old)
    assert 0 < n < budget and view["turns"][0]["continued"] == 1 and reply["choices"][0]["finish_reason"] == "length"
    assert sample.token_versions == [old] * n + [old + 1] * (budget - n)
    assert sample.weight_versions == [str(old), str(old + 1)] and sample.response_length == budget
    out = sample.response_tokens
    # the stream never went back: every partial extends the one before, and the last is the whole turn
    assert all(a.output_ids == b.output_ids[:len(a.output_ids)] for a, b in zip(streamed, streamed[1:]))
    assert streamed[-1].output_ids == out and streamed[-1].logprobs == sample.rollout_logprobs
    assert reply["usage"]["completion_tokens"] == budget
