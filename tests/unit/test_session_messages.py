"""OpenAI messages at the session edge: validation errors name the message and field, resent replies
compare loosely where clients reserialize them, sampled text parses into reasoning and tool calls, and
request bodies translate into engine sampling params (or a 400 naming the field)."""

import json

import pytest

from verst.session.errors import SessionError
from verst.session.messages import (
    check_tool_results,
    first_difference,
    normalize_messages,
    parse_reply,
    same_message,
)
from verst.session.openai_wire import TokenTexts, completion, parse_request
from verst.session.streaming import ChunkStream


@pytest.mark.parametrize("raw, field, words", [
    ([], "messages", "non-empty list"),
    ("hello", "messages", "non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], "messages[1]", "must be an object"),
    ([{"role": "robot", "content": "a"}], "messages[0].role", "'robot' is not one of"),
    ([{"role": "user"}], "messages[0].content", "needs text"),
    ([{"role": "user", "content": 3}], "messages[0].content", "must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]",
     "not a text part"),
    ([{"role": "user", "content": "a", "audio": {"id": "x"}}], "messages[0].audio", "not supported"),
    ([{"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]}], "messages[0].tool_calls",
     "only assistant"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
     "messages[0].tool_calls[0].function.name", "needs function.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
])
def test_malformed_messages_are_bad_requests_naming_the_field(raw, field, words):
    with pytest.raises(SessionError) as err:
        normalize_messages(raw)
    assert err.value.status == 400 and err.value.field == field and words in err.value.message


def test_normal_form_keeps_what_templates_read_and_drops_empty_client_extras():
    dumped = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
              "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalize_messages([dumped, parts]) == [
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}, "id": "call_1"}]},
        {"role": "user", "content": "ab"},
    ]


def test_a_resent_reply_matches_loosely_but_not_a_changed_one():
    stored = parse_reply('<think>\nhm\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
                         True)
    call = stored["tool_calls"][0]
    resent = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}]}
    assert same_message(stored, resent)  # content None == "", JSON-equal arguments, ids ignored, reasoning omitted
    assert not same_message(stored, {**resent, "reasoning_content": "changed"})
    changed = {**resent, "tool_calls": [{**call, "function": {"name": "add", "arguments": '{"a": 2}'}}]}
    assert not same_message(stored, changed)
    assert not same_message({"role": "tool", "content": "3", "tool_call_id": "a"}, {"role": "tool", "content": "3"})


def test_first_difference_is_the_first_changed_or_missing_stored_message():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert first_difference(history, history + [{"role": "user", "content": "c"}]) is None
    assert first_difference(history, history[:1]) == 1
    assert first_difference(history, [{"role": "user", "content": "x"}, history[1]]) == 0


def test_sampled_text_parses_into_reasoning_content_and_tool_calls():
    text = ('<think>\nadd them\n</think>\n\nLet me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
            '</tool_call>\n<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>')
    reply = parse_reply(text, parse_tools=True)
    assert reply["reasoning_content"] == "add them" and reply["content"] == "Let me add."
    calls = reply["tool_calls"]
    named = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert named == [("add", {"a": 1}), ("mul", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    only_calls = parse_reply('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', True)
    assert only_calls["content"] is None
    # a block that is not a JSON call, or tools off for the request: the text stays content, as sampled
    broken = "<tool_call>\n{not json\n</tool_call>"
    assert parse_reply(broken, True) == {"role": "assistant", "content": broken}
    assert "tool_calls" not in parse_reply(text, parse_tools=False)


def test_request_fields_become_engine_sampling_params():
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "a"}], "temperature": 0,
                         "top_p": 0.9, "seed": 7, "max_tokens": 5, "stop": ["\n"], "top_k": 3, "logprobs": True,
                         "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "none",
                         "tools": [{"type": "function", "function": {"name": "f"}}], "n": 1})
    assert req.sampling == {"temperature": 0, "top_p": 0.9, "sampling_seed": 7, "stop": ["\n"], "top_k": 3}
    flags = (req.max_tokens, req.logprobs, req.stream, req.include_usage, req.parse_tools)
    assert flags == (5, True, True, True, False)


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": "a"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "a"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": "yes"}, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": "add"}, "tools"),
    ({"messages": []}, "messages"),
    ([1, 2], "body"),
])
def test_bad_request_fields_are_400_naming_the_field(body, field):
    with pytest.raises(SessionError) as err:
        parse_request(body)
    assert err.value.status == 400 and err.value.field == field


def test_a_turn_that_streamed_no_tokens_finishes_as_one_chunk_then_done():
    message = parse_reply('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', True)
    reply = completion(completion_id="c1", model="m", message=message, finish_reason="tool_calls",
                       logprob_entries=[{"token": t, "logprob": lp, "bytes": [ord(t)], "top_logprobs": []}
                                        for t, lp in (("a", -0.5), ("b", -0.25))],
                       n_out=2, prompt_tokens=3, cached_tokens=1, metadata={})
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                              "prompt_tokens_details": {"cached_tokens": 1}}
    events = ChunkStream(None, model="m", parse_tools=True, logprobs=True, include_usage=True,
                         token_texts=TokenTexts(None)).finish(reply)
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 3
    chunk = json.loads(events[0][len("data: "):])
    assert chunk["object"] == "chat.completion.chunk"
    choice = chunk["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["delta"]["tool_calls"][0]["index"] == 0
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert json.loads(events[1][len("data: "):])["usage"]["total_tokens"] == 5


CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("tool, words", [
    ({"role": "tool", "content": "3"}, "messages[2].tool_call_id is missing; a tool message answers a tool call"),
    ({"role": "tool", "content": "3", "tool_call_id": "c2"},
     "messages[2].tool_call_id = 'c2' matches no tool call of an earlier assistant message (their ids: ['c1'])"),
])
def test_a_tool_message_must_answer_an_earlier_tool_call_by_its_id(tool, words):
    messages = normalize_messages([{"role": "user", "content": "a"}, CALLED, tool])
    with pytest.raises(SessionError) as err:
        check_tool_results(messages)
    assert (err.value.status, err.value.field) == (400, "messages[2].tool_call_id") and words in err.value.message
    check_tool_results(normalize_messages([{"role": "user", "content": "a"}, CALLED, {**tool, "tool_call_id": "c1"}]))


def test_tool_call_ids_of_stored_replies_count_when_the_client_drops_them():
    resent = {**CALLED, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    messages = normalize_messages([{"role": "user", "content": "a"}, resent,
                                   {"role": "tool", "content": "3", "tool_call_id": "c1"}])
    with pytest.raises(SessionError):
        check_tool_results(messages)
    check_tool_results(messages, stored=normalize_messages([{"role": "user", "content": "a"}, CALLED]))
