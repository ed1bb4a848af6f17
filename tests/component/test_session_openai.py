"""The session server as an agent developer meets it through the official `openai` client, on 127.0.0.1 in
front of the embedded engine (tiny model, in this process): replies and stream chunks validate strictly
against the client's types, models list, requests beyond the context and unanswered tool results are
refused naming the field, engine refusals hide the engine's address, streamed turns record the ids an
unstreamed one does, and the client's own retry of a lost reply rolls the turn back."""

import asyncio
import warnings

import httpx
import openai
import pytest
import torch
from openai.types import Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.client import EngineClient
from verst.models.loader import chat_prompt_ids, load_model_and_tokenizer
from verst.session.http import SessionServer
from verst.session.manager import SessionManager
from verst.session.scripted import ScriptedEngine
from verst.types import Sample

torch.set_num_threads(1)
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
USER = {"role": "user", "content": "What is 1+2?"}
ASKED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
SAMPLING = {"temperature": 1.0, "seed": 3, "max_tokens": 12}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    # no prefix cache: a turn's logits do not depend on what an earlier session left cached
    config = EngineConfig(max_running_requests=8, prefix_cache_tokens=0)
    with BackgroundServer(EngineCore(model, tokenizer, config)) as server:
        yield server, tokenizer


def run(served, body, **manager_kw):
    """`body(server, new_client)` against a session server in front of the embedded engine;
    `new_client(**kw)` opens a session and returns an AsyncOpenAI client on it."""
    engine, tok = served

    async def main():
        async with EngineClient(engine.url) as client, SessionServer(SessionManager(client, tok, **manager_kw)) as srv:
            def new_client(**kw):
                kw.setdefault("max_retries", 0)
                base = f"{srv.url}/sessions/{srv.manager.create()}/v1"
                return openai.AsyncOpenAI(base_url=base, api_key="unused", **kw)
            return await body(srv, new_client)

    return asyncio.run(main())


async def refused(coro) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        await coro
    return err.value


def session_id(oai) -> str:
    return str(oai.base_url).rstrip("/").split("/")[-2]


async def collect(server, sid) -> Sample:
    async with httpx.AsyncClient(base_url=server.url) as http:
        (sample,) = (await http.post(f"/sessions/{sid}/samples")).json()["samples"]
    return Sample.from_dict(sample).validate()


def test_max_tokens_beyond_the_context_is_refused_naming_the_field(served):
    _, tok = served
    n = len(chat_prompt_ids(tok, [USER]))

    async def body(server, new_client):
        oai = new_client()
        errors = [await refused(oai.chat.completions.create(model="tiny", messages=[USER], **{field: 10**9}))
                  for field in ("max_tokens", "max_completion_tokens")]
        fits = await oai.chat.completions.create(model="tiny", messages=[USER], max_tokens=4)
        return errors, fits, server.manager.context_length

    errors, fits, context_length = run(served, body)
    assert context_length == 1024  # the tiny model's max_position_embeddings, as the engine reports it
    for err, field in zip(errors, ("max_tokens", "max_completion_tokens")):
        assert (err.status_code, err.param) == (400, field)
        assert err.body["message"] == (
            f"{field} = 1000000000 exceeds the context: the model's maximum context length is 1024 tokens and this "
            f"request asks for {n + 10**9} ({n} in the messages, 1000000000 in the completion); lower {field} or "
            "shorten the messages")
    assert fits.usage.completion_tokens <= 4

    async def budget(server, new_client):
        return await refused(new_client().chat.completions.create(model="tiny", messages=[USER], max_tokens=10**9))

    err = run(served, budget, max_context_tokens=64)
    assert (err.status_code, err.param) == (400, "max_tokens")
    assert err.body["message"] == ("max_tokens = 1000000000 exceeds the session's context: max_context_tokens = 64 "
                                   "holds the messages and the completion together; lower max_tokens")


def test_replies_validate_strictly_against_the_client_types(served):
    async def body(server, new_client):
        oai = new_client()
        raws, messages = [], [USER]
        for _ in range(2):
            raw = await oai.chat.completions.with_raw_response.create(model="tiny", messages=messages, logprobs=True,
                                                                     **SAMPLING)
            raws.append(raw)
            messages += [raw.parse().choices[0].message, {"role": "user", "content": "And then?"}]
        return session_id(oai), raws

    sid, raws = run(served, body)
    for turn, raw in enumerate(raws):
        reply = ChatCompletion.model_validate_json(raw.text, strict=True)
        assert reply.metadata == {"session_id": sid, "turn": str(turn), "weight_version": "0"}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # pydantic's serializer warns on a field of the wrong type
            raw.parse().model_dump()
            raw.parse().model_dump_json()


def test_models_list_and_retrieve(served):
    async def body(server, new_client):
        oai = new_client()
        raw = await oai.models.with_raw_response.list()
        listed = [m async for m in await oai.models.list()]
        one = await oai.models.retrieve("verst")
        missing = await refused(oai.models.retrieve("gpt-4o"))
        unknown = await refused(openai.AsyncOpenAI(base_url=f"{server.url}/sessions/nope/v1", api_key="unused",
                                                   max_retries=0).models.list())
        return raw, listed, one, missing, unknown

    raw, listed, one, missing, unknown = run(served, body)
    for card in raw.http_response.json()["data"]:
        Model.model_validate(card, strict=True)
    assert [m.id for m in listed] == ["verst"] and (one.id, one.object, one.owned_by) == ("verst", "model", "verst")
    assert missing.status_code == 404 and missing.body["message"] == (
        "model 'gpt-4o' is not served here; the session server serves 'verst'")
    assert unknown.status_code == 404 and "unknown session 'nope'" in unknown.body["message"]


def test_a_route_the_server_does_not_serve_is_refused_in_an_openai_error_body(served):
    async def body(server, new_client):
        oai = new_client()
        embeddings = await refused(oai.embeddings.create(model="verst", input="hi"))
        async with httpx.AsyncClient(base_url=str(oai.base_url)) as http:
            wrong_method = await http.get("chat/completions")
        return session_id(oai), embeddings, wrong_method

    sid, embeddings, wrong_method = run(served, body)
    assert embeddings.status_code == 404 and embeddings.body == {
        "message": f"POST /sessions/{sid}/v1/embeddings: Not Found", "type": "not_found_error", "param": "path",
        "code": 404}
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["message"] == f"GET /sessions/{sid}/v1/chat/completions: Method Not Allowed"


def test_a_tool_message_must_answer_an_earlier_tool_call(served):
    async def body(server, new_client):
        oai = new_client()
        missing = await refused(oai.chat.completions.create(
            model="tiny", messages=[USER, ASKED, {"role": "tool", "content": "3"}], tools=[ADD]))
        unmatched = await refused(oai.chat.completions.create(
            model="tiny", messages=[USER, ASKED, {"role": "tool", "content": "3", "tool_call_id": "call_8"}],
            tools=[ADD]))
        answered = await oai.chat.completions.create(
            model="tiny", messages=[USER, ASKED, {"role": "tool", "content": "3", "tool_call_id": "call_7"}],
            tools=[ADD], max_tokens=2)
        return missing, unmatched, answered

    missing, unmatched, answered = run(served, body)
    assert (missing.status_code, missing.param) == (400, "messages[2].tool_call_id")
    assert missing.body["message"] == ("messages[2].tool_call_id is missing; a tool message answers a tool call "
                                       "of an earlier assistant message by its id")
    assert (unmatched.status_code, unmatched.param) == (400, "messages[2].tool_call_id")
    assert unmatched.body["message"] == ("messages[2].tool_call_id = 'call_8' matches no tool call of an earlier "
                                         "assistant message (their ids: ['call_7'])")
    assert answered.usage.completion_tokens <= 2


def test_an_engine_refusal_names_the_field_and_not_the_engine_address(served):
    engine, _ = served

    async def body(server, new_client):
        return await refused(new_client().chat.completions.create(model="tiny", messages=[USER], temperature=-1.0))

    err = run(served, body)
    assert (err.status_code, err.param) == (400, "temperature")
    # the engine reads an integral JSON number as an integer, as JSON Schema does
    assert err.body["message"] == ("the engine refused the request (422): temperature = -1: Input should be "
                                   "greater than or equal to 0")
    assert engine.url not in err.message and "127.0.0.1" not in err.message


def test_a_streamed_turn_comes_token_by_token_and_records_the_ids_of_an_unstreamed_one(served):
    async def body(server, new_client):
        plain, streamed, raw_client = new_client(), new_client(), new_client()
        reply = await plain.chat.completions.create(model="tiny", messages=[USER], logprobs=True, **SAMPLING)
        stream = await streamed.chat.completions.create(model="tiny", messages=[USER], logprobs=True, stream=True,
                                                        stream_options={"include_usage": True}, **SAMPLING)
        chunks = [chunk async for chunk in stream]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        # the agent sends the accumulated reply back: the history must still match the stored one
        messages = [USER, {"role": "assistant", "content": content}, {"role": "user", "content": "And then?"}]
        await streamed.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
        async with raw_client.chat.completions.with_streaming_response.create(
                model="tiny", messages=[USER], stream=True, stream_options={"include_usage": True},
                logprobs=True, **SAMPLING) as response:
            lines = [line async for line in response.iter_lines() if line.startswith("data: ")]
        samples = [await collect(server, session_id(c)) for c in (plain, streamed)]
        return reply, chunks, content, lines, samples

    reply, chunks, content, lines, (plain, streamed) = run(served, body)
    *deltas, usage = chunks
    assert len(deltas) > 2 and content == reply.choices[0].message.content  # token by token, the same text
    assert [c.choices[0].finish_reason for c in deltas][-1] == reply.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    assert [e.logprob for c in deltas if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == [
        e.logprob for e in reply.choices[0].logprobs.content]
    assert usage.choices == [] and usage.usage.model_dump() == reply.usage.model_dump()
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:  # every chunk on the wire, strictly
        ChatCompletionChunk.model_validate_json(line[len("data: "):], strict=True)
    n = plain.response_length  # the streamed session took one more turn; its first is the plain one
    assert streamed.tokens[:len(plain.tokens)] == plain.tokens
    assert streamed.loss_mask[:n] == plain.loss_mask and streamed.rollout_logprobs[:n] == plain.rollout_logprobs


def test_a_streamed_tool_call_accumulates_into_the_stored_reply(served):
    _, tok = served
    engine = ScriptedEngine(tok, ["Let me add.\n" + CALL, "The sum is 3."])

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client, \
                SessionServer(SessionManager(client, tok)) as server:
            sid = server.manager.create()
            oai = openai.AsyncOpenAI(base_url=f"{server.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
            # the client's own stream helper accumulates the chunks into one completion
            async with oai.chat.completions.stream(model="m", messages=[USER], tools=[ADD]) as stream:
                pieces = [event.delta async for event in stream if event.type == "content.delta"]
                first = await stream.get_final_completion()
            message = first.choices[0].message
            call = message.tool_calls[0]
            second = await oai.chat.completions.create(model="m", tools=[ADD], messages=[
                USER, message, {"role": "tool", "tool_call_id": call.id, "content": "3"}])
            return pieces, first, second, await collect(server, sid)

    pieces, first, second, sample = asyncio.run(main())
    assert len(pieces) > 1  # the content streamed before the call was known
    assert "".join(pieces) == first.choices[0].message.content == "Let me add."
    assert first.choices[0].finish_reason == "tool_calls"
    assert first.choices[0].message.tool_calls[0].function.name == "add"
    assert second.choices[0].message.content == "The sum is 3."  # the resent streamed reply matched
    c0, c1 = engine.calls
    assert sample.tokens == c1.input_ids + c1.output_ids and c1.input_ids[:len(c0.input_ids) + len(c0.output_ids)] == (
        c0.input_ids + c0.output_ids)


class LoseFirstReply(httpx.AsyncBaseTransport):
    """Forwards requests; the first chat completion's reply is lost on the way back (the turn ran)."""

    def __init__(self):
        self.inner, self.lost = httpx.AsyncHTTPTransport(), 0

    async def handle_async_request(self, request):
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/chat/completions") and not self.lost:
            self.lost += 1
            await response.aread()
            await response.aclose()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response

    async def aclose(self):
        await self.inner.aclose()


def test_the_clients_own_retry_of_a_lost_reply_rolls_the_turn_back(served):
    async def body(server, new_client):
        transport = LoseFirstReply()
        async with httpx.AsyncClient(transport=transport) as http:
            oai = new_client(max_retries=2, http_client=http)
            reply = await oai.chat.completions.create(model="tiny", messages=[USER], **SAMPLING)
        sid = session_id(oai)
        return transport.lost, reply, server.manager.get(sid), await collect(server, sid)

    lost, reply, view, sample = run(served, body)
    assert lost == 1 and view["rollbacks"] == 1 and len(view["turns"]) == 1  # the retry replaced the lost turn
    assert sample.response_length == reply.usage.completion_tokens and len(sample.weight_versions) == 1
