"""SessionManager without sockets: the real engine client in front of a scripted engine at the HTTP edge
(verst.session.scripted). Exact ids across turns with tool calls, the session id as routing key on every
engine request, one-step rollback, divergence, bad input, engine failures, limits, metrics."""

import asyncio

import httpx
import pytest

from verst.inference_client.client import EngineClient
from verst.models.loader import chat_prompt_ids
from verst.session.errors import SessionError
from verst.session.manager import SessionManager
from verst.session.scripted import Reply, ScriptedEngine
from verst.types import Status

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
USER = {"role": "user", "content": "What is 1+2?"}
TOOL_TURN = "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def session_run(tok, script, body, **manager_kw):
    """`body(manager, engine)` against a scripted engine behind the real engine client."""
    engine = ScriptedEngine(tok, script)

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            return await body(SessionManager(client, tok, **manager_kw), engine)

    return asyncio.run(main())


def resend(reply: dict) -> dict:
    """The reply as an agent sends it back (the client's serialization, empty extras included)."""
    return {**reply["choices"][0]["message"], "refusal": None, "annotations": []}


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)



async def two_tool_turns(m, sid, script_tool="3"):
    first = await m.chat_completion(sid, {"messages": [USER], "tools": [ADD], "logprobs": True})
    call_id = first["choices"][0]["message"]["tool_calls"][0]["id"]
    tool = {"role": "tool", "content": script_tool, "tool_call_id": call_id}
    history = [USER, resend(first), tool]
    second = await m.chat_completion(sid, {"messages": history, "tools": [ADD]})
    return first, second, history


def test_tool_call_turns_join_the_engines_ids_and_the_tool_message_ids_exactly(tok):
    tracked = []

    async def body(m, engine):
        sid = m.create({"task": "add"}, on_request=lambda rid, started: tracked.append((rid, started)))
        first, second, _ = await two_tool_turns(m, sid)
        return sid, first, second, m.samples(sid)[0], m.get(sid), m.metrics(), engine.calls

    sid, first, second, sample, view, metrics, calls = session_run(tok, [CALL, "The sum is 3."], body)
    c0, c1 = calls
    assert [c.routing_key for c in calls] == [sid, sid]  # every engine request pins the session
    prompt = chat_prompt_ids(tok, [USER], tools=[ADD])
    tool_ids = encode(tok, TOOL_TURN)  # the template's '\n' after <|im_end|>, then the tool turn
    assert c0.input_ids == prompt
    assert c1.input_ids == prompt + c0.output_ids + tool_ids  # the engine sees its own ids back
    assert sample.tokens == c1.input_ids + c1.output_ids
    assert sample.loss_mask == [1] * len(c0.output_ids) + [0] * len(tool_ids) + [1] * len(c1.output_ids)
    assert sample.rollout_logprobs == c0.logprobs + [0.0] * len(tool_ids) + c1.logprobs
    assert sample.status is Status.COMPLETED and sample.weight_versions == ["0", "0"]
    assert sample.response == "The sum is 3." and sample.metadata["tito_mismatch"] == []
    # the OpenAI replies: tool calls parsed out of the sampled text, logprobs of every output id
    msg = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    content = first["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == c0.logprobs and content[-1]["token"] == "<|im_end|>"
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "The sum is 3."}
    assert second["choices"][0]["finish_reason"] == "stop" and second["choices"][0]["logprobs"] is None
    assert second["usage"]["prompt_tokens"] == len(c1.input_ids)
    assert tracked == [(c0.rid, True), (c0.rid, False), (c1.rid, True), (c1.rid, False)]
    assert view["metadata"] == {"task": "add"} and view["finish_reasons"] == ["stop", "stop"]
    assert view["n_prompt_tokens"] == len(prompt) and view["n_tokens"] == len(sample.tokens)
    assert metrics["rollout/tito_mismatch_rate/any"] == 0.0 and metrics["rollout/tito_checked_sessions"] == 1.0


def test_retrying_the_last_turn_rolls_it_back_once(tok):
    async def body(m, engine):
        sid = m.create()
        _, _, history = await two_tool_turns(m, sid)
        retried = await m.chat_completion(sid, {"messages": history, "tools": [ADD]})  # same request again
        return m.samples(sid)[0], m.get(sid), retried, engine.calls

    sample, view, retried, calls = session_run(tok, [CALL, "The sum is 3.", "It is 3."], body)
    assert calls[2].input_ids == calls[1].input_ids  # the retry re-sends the same prompt
    assert sample.tokens == calls[2].input_ids + calls[2].output_ids
    assert sample.rollout_logprobs[-len(calls[2].output_ids):] == calls[2].logprobs
    assert view["rollbacks"] == 1 and len(view["turns"]) == 2
    assert retried["choices"][0]["message"]["content"] == "It is 3."


def test_a_first_turn_retry_starts_over(tok):
    async def body(m, engine):
        sid = m.create()
        await m.chat_completion(sid, {"messages": [USER]})
        await m.chat_completion(sid, {"messages": [{"role": "user", "content": "What is 2+2?"}]})
        return m.samples(sid)[0], engine.calls

    sample, calls = session_run(tok, ["3", "4"], body)
    assert sample.tokens == calls[1].input_ids + calls[1].output_ids
    assert sample.prompt_tokens == chat_prompt_ids(tok, [{"role": "user", "content": "What is 2+2?"}])


def test_histories_that_do_not_extend_the_session_are_refused_naming_the_message(tok):
    async def body(m, engine):
        sid = m.create()
        first, second, history = await two_tool_turns(m, sid)
        full = history + [resend(second)]
        cases = {
            "changed user": [{"role": "user", "content": "What is 9+9?"}, *full[1:], {"role": "user", "content": "?"}],
            "changed reply": [USER, {"role": "assistant", "content": "made up"}, *full[2:],
                              {"role": "user", "content": "?"}],
            "two turns back": [USER],
            "new assistant": full + [{"role": "assistant", "content": "injected"}, {"role": "user", "content": "?"}],
            "nothing new": full,
            "other tools": full + [{"role": "user", "content": "?"}],
        }
        errors = {}
        for name, messages in cases.items():
            tools = [] if name == "other tools" else [ADD]
            with pytest.raises(SessionError) as err:
                await m.chat_completion(sid, {"messages": messages, "tools": tools})
            errors[name] = err.value
        return errors, m.get(sid), len(engine.calls)

    errors, view, n_calls = session_run(tok, [CALL, "The sum is 3."], body)
    assert all(e.status == 400 for e in errors.values())
    assert errors["changed user"].field == "messages[0]"
    assert "stored user 'What is 1+2?'" in errors["changed user"].message
    assert errors["changed reply"].field == "messages[1]" and "calling ['add']" in errors["changed reply"].message
    assert errors["two turns back"].field == "messages[1]"  # only the last turn may be retried
    assert errors["new assistant"].field == "messages[4]" and "did not produce" in errors["new assistant"].message
    assert "append a user or tool message" in errors["nothing new"].message
    assert errors["other tools"].field == "tools"
    assert view["n_tokens"] > 0 and len(view["turns"]) == 2 and n_calls == 2  # none of it reached the engine


def test_unknown_sessions_are_404(tok):
    async def body(m, engine):
        sid = m.create()
        m.delete(sid)
        found = []
        for call in (lambda: m.get(sid), lambda: m.delete(sid), lambda: m.samples(sid), lambda: m.get("nope")):
            with pytest.raises(SessionError) as err:
                call()
            found.append((err.value.status, err.value.field))
        with pytest.raises(SessionError) as err:
            await m.chat_completion(sid, {"messages": [USER]})
        return found + [(err.value.status, err.value.field)]

    assert session_run(tok, ["x"], body) == [(404, "session_id")] * 5


def test_an_unreachable_engine_is_502_and_leaves_the_session_as_it_was(tok):
    async def body(m, engine):
        sid = m.create()
        await m.chat_completion(sid, {"messages": [USER]})
        before = m.get(sid)
        engine.down.add(sid)
        with pytest.raises(SessionError) as err:
            await m.chat_completion(sid, {"messages": [USER, {"role": "assistant", "content": "3"},
                                                        {"role": "user", "content": "sure?"}]})
        after = m.get(sid)
        engine.down.clear()  # the agent retries once the engine is back: the turn is as if never failed
        await m.chat_completion(sid, {"messages": [USER, {"role": "assistant", "content": "3"},
                                                   {"role": "user", "content": "sure?"}]})
        return err.value, before, after, m.samples(sid)[0], engine.calls

    err, before, after, sample, calls = session_run(tok, ["3", "yes"], body)
    assert err.status == 502 and err.field == "engine" and "ConnectError" in err.message and "is down" in err.message
    assert after == before
    assert sample.tokens == calls[-1].input_ids + calls[-1].output_ids and len(sample.weight_versions) == 2


def test_an_engine_refusing_the_parameters_is_a_bad_request(tok):
    refusing = httpx.MockTransport(lambda request: httpx.Response(
        422, json={"error": {"message": "sampling_params.top_k = 0 keeps no token"}}))

    async def main():
        async with EngineClient("http://engine", transport=refusing) as client:
            m = SessionManager(client, tok)
            with pytest.raises(SessionError) as err:
                await m.chat_completion(m.create(), {"messages": [USER], "top_k": 0})
            return err.value

    err = asyncio.run(main())
    assert err.status == 400 and "422" in err.message and "top_k = 0" in err.message and err.field == "top_k"
    assert "http://engine" not in err.message  # the engine's address stays in the log


def test_an_aborted_turn_ends_the_session_and_the_sample(tok):
    async def body(m, engine):
        sid = m.create()
        reply = await m.chat_completion(sid, {"messages": [USER]})
        with pytest.raises(SessionError, match="was aborted by the engine") as err:
            await m.chat_completion(sid, {"messages": [USER, resend(reply), {"role": "user", "content": "?"}]})
        return reply, err.value, m.samples(sid)[0]

    reply, err, sample = session_run(tok, [Reply("par", finish="abort")], body)
    assert reply["choices"][0]["finish_reason"] == "abort" and err.status == 400
    assert sample.status is Status.ABORTED and "aborted by the engine" in sample.metadata["session_error"]


def test_the_context_limit_caps_each_turn_and_ends_the_trajectory_truncated(tok):
    n_prompt = len(chat_prompt_ids(tok, [USER]))

    async def body(m, engine):
        sid = m.create()
        first = await m.chat_completion(sid, {"messages": [USER], "max_tokens": 30})
        full = await m.chat_completion(sid, {"messages": [USER, resend(first), {"role": "user", "content": "?"}]})
        with pytest.raises(SessionError, match="reached max_context_tokens"):
            await m.chat_completion(sid, {"messages": [USER, resend(first), {"role": "user", "content": "?"}]})
        long = m.create()
        with pytest.raises(SessionError, match=f"prompt has {n_prompt + 11} tokens") as err:
            await m.chat_completion(long, {"messages": [{"role": "user", "content": USER["content"] + " Say it now"}]})
        return first, full, m.samples(sid)[0], err.value, engine.calls

    first, full, sample, err, calls = session_run(tok, ["The answer is three."], body, max_context_tokens=n_prompt + 5)
    assert calls[0].sampling_params["max_new_tokens"] == 5 and len(calls) == 1
    assert first["choices"][0]["finish_reason"] == "length"
    assert full["choices"][0]["finish_reason"] == "length" and full["choices"][0]["message"]["content"] == ""
    assert sample.status is Status.TRUNCATED and "no room under max_context_tokens" in sample.metadata["session_error"]
    assert len(sample.tokens) == n_prompt + 5 and err.status == 400


def test_samples_cut_at_a_turn_boundary_and_sampling_defaults_apply(tok):
    async def body(m, engine):
        sid = m.create()
        await two_tool_turns(m, sid)
        return m.samples(sid, max_tokens=len(engine.calls[1].input_ids))[0], engine.calls

    sample, calls = session_run(tok, [CALL, "The sum is 3."], body, default_sampling={"top_k": 5, "temperature": 0.5},
                                max_new_tokens=100)
    assert sample.tokens == calls[0].input_ids + calls[0].output_ids and sample.status is Status.TRUNCATED
    assert calls[0].sampling_params == {"top_k": 5, "temperature": 0.5, "max_new_tokens": 100}


def test_requests_of_one_session_run_one_at_a_time(tok):
    async def body(m, engine):
        engine.delay_s = 0.05
        sid = m.create()
        # the same first-turn request twice at once: the second waits, then retries the first turn
        await asyncio.gather(*(m.chat_completion(sid, {"messages": [USER]}) for _ in range(2)))
        return m.get(sid), engine.calls

    view, calls = session_run(tok, ["3", "three"], body)
    assert len(calls) == 2 and calls[0].input_ids == calls[1].input_ids
    assert view["rollbacks"] == 1 and len(view["turns"]) == 1
