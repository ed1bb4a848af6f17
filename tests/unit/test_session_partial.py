"""Partial rollouts in the session server, against the scripted engine behind the real engine client: a turn
whose engine call a weight update aborted goes on inside the turn (input ids + the output so far, the rest of
the budget), the agent sees one completion, the trajectory keeps the exact ids and each output id's version.
Switched off, for another abort, or once the caller stopped the episode, the turn ends aborted as before."""

import asyncio

import pytest

from verst.inference_client.client import EngineClient
from verst.inference_client.protocol import SGLANG_ABORT, WEIGHT_UPDATE_ABORT
from verst.session.manager import SessionManager
from verst.session.scripted import Reply, ScriptedEngine
from verst.types import Status

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
USER = {"role": "user", "content": "What is 1+2?"}
BUDGET = 40  # max_tokens of the answer turn


def aborted(text, message=WEIGHT_UPDATE_ABORT, version="3"):
    return Reply(text, finish="abort", message=message, weight_version=version)


def episode(tok, script, *, stream=False, stopped=None, **manager_kw):
    """A tool call, its result, then the answer turn the rest of the script makes (version 3 unless a reply
    says otherwise); what the engine and the agent saw, the session's view and its sample."""
    engine = ScriptedEngine(tok, script, weight_version="3")
    streamed = []

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            m = SessionManager(client, tok, **manager_kw)
            sid = m.create(stopped=stopped)
            first = await m.chat_completion(sid, {"messages": [USER], "tools": [ADD]})
            call_id = first["choices"][0]["message"]["tool_calls"][0]["id"]
            tool = {"role": "tool", "content": "3", "tool_call_id": call_id}
            history = [USER, {**first["choices"][0]["message"]}, tool]
            on_tokens = streamed.append if stream else None
            second = await m.chat_completion(sid, {"messages": history, "tools": [ADD], "max_tokens": BUDGET,
                                                   "logprobs": True}, on_tokens=on_tokens)
            return second, m.get(sid), m.samples(sid)[0]

    second, view, sample = asyncio.run(main())
    return engine.calls, second, view, sample, streamed


def test_a_turn_a_weight_update_aborted_goes_on_inside_the_turn_with_the_new_weights(tok):
    script = [Reply(CALL, weight_version="2"), aborted("The sum"), Reply(" is 3.", weight_version="4")]
    calls, reply, view, sample, _ = episode(tok, script, partial_rollout=True)
    tool_call, cut, rest = calls
    # token in, token out: the continuation is sent the turn's input ids and its output so far, with the rest
    assert rest.input_ids == cut.input_ids + cut.output_ids
    assert cut.sampling_params["max_new_tokens"] == BUDGET
    assert rest.sampling_params["max_new_tokens"] == BUDGET - len(cut.output_ids)
    assert rest.routing_key == cut.routing_key  # the same engine holds the prefix
    # the agent sees one ordinary completion: the joined text, the last call's finish, every output id's logprob
    choice = reply["choices"][0]
    assert choice["message"]["content"] == "The sum is 3." and choice["finish_reason"] == "stop"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == cut.logprobs + rest.logprobs
    assert reply["usage"]["completion_tokens"] == len(cut.output_ids) + len(rest.output_ids)
    assert view["ended"] is None and view["turns"][1]["continued"] == 1 and len(view["turns"]) == 2
    # the trajectory's ids are exactly the engine's, the turn's output spanning both calls
    assert sample.tokens == rest.input_ids + rest.output_ids
    n_env = len(cut.input_ids) - len(tool_call.input_ids) - len(tool_call.output_ids)
    out = cut.output_ids + rest.output_ids
    assert sample.loss_mask == [1] * len(tool_call.output_ids) + [0] * n_env + [1] * len(out)
    assert sample.rollout_logprobs == tool_call.logprobs + [0.0] * n_env + cut.logprobs + rest.logprobs
    # each token's version: the tool call by 2, the tool result read by 3 (the call that follows it), the answer
    # by 3 until the update, then by 4
    assert sample.token_versions == ([2] * len(tool_call.output_ids) + [3] * n_env + [3] * len(cut.output_ids)
                                     + [4] * len(rest.output_ids))
    assert sample.weight_versions == ["2", "3", "4"] and sample.status is Status.COMPLETED
    assert sample.response == "The sum is 3."


def test_every_update_continues_again_and_a_streamed_turn_keeps_growing(tok):
    script = [CALL, aborted("The"), aborted(" sum", SGLANG_ABORT, "4"), Reply(" is 3.", weight_version="5")]
    calls, reply, _, sample, streamed = episode(tok, script, stream=True, partial_rollout=True)
    _, a, b, c = calls
    assert [x.sampling_params["max_new_tokens"] for x in (a, b, c)] == [
        BUDGET, BUDGET - len(a.output_ids), BUDGET - len(a.output_ids) - len(b.output_ids)]
    assert c.input_ids == a.input_ids + a.output_ids + b.output_ids
    out = a.output_ids + b.output_ids + c.output_ids
    # the cumulative partial the stream reports grows by one id per event across both continuations
    assert [p.output_ids for p in streamed] == [out[:n] for n in range(1, len(out) + 1)]
    assert streamed[-1].logprobs == a.logprobs + b.logprobs + c.logprobs
    assert len({p.rid for p in streamed}) == 1 and reply["id"] == f"chatcmpl-{streamed[0].rid}"
    assert reply["choices"][0]["message"]["content"] == "The sum is 3."
    assert sample.token_versions[-len(out):] == [3] * len(a.output_ids) + [4] * len(b.output_ids) + [5] * len(
        c.output_ids)


def test_without_partial_rollouts_the_turn_ends_aborted_as_before(tok):
    calls, reply, view, sample, _ = episode(tok, [CALL, aborted("The sum"), Reply(" is 3.")])
    assert len(calls) == 2 and reply["choices"][0]["finish_reason"] == "abort"
    assert view["ended"].startswith("turn 1 was aborted by the engine")
    assert sample.status is Status.ABORTED and sample.token_versions is None  # recorded only with partial rollouts


@pytest.mark.parametrize("why", ["another abort", "the caller stopped the episode"])
def test_an_abort_that_is_not_a_weight_update_is_not_continued(tok, why):
    if why == "another abort":
        script, stopped = [CALL, aborted("The sum", "engine shutting down")], None
    else:  # SGLang's abort by rid reads like an update's; the rollout step's end sent it
        script, stopped = [CALL, aborted("The sum", SGLANG_ABORT)], lambda: True
    calls, reply, view, sample, _ = episode(tok, [*script, Reply(" is 3.")], stopped=stopped, partial_rollout=True)
    assert len(calls) == 2 and reply["choices"][0]["finish_reason"] == "abort" and view["turns"][1]["continued"] == 0
    assert sample.status is Status.ABORTED


def test_a_turn_an_update_fell_inside_leaves_the_token_versions_unknown(tok):
    # retract / in_place: the engine went on itself and says only the oldest and newest version of the call
    script = [CALL, Reply("The sum is 3.", weight_version="4", oldest_weight_version="3")]
    calls, _, _, sample, _ = episode(tok, script, partial_rollout=True)
    assert len(calls) == 2 and sample.token_versions is None and sample.weight_versions == ["3", "3"]
    assert sample.validate()
