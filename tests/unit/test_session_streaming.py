"""A streamed turn's chunks, token by token: the content a client accumulates from the deltas is exactly the
reply's parsed content (so a resent history matches the stored one), reasoning and tool calls arrive whole,
every output id's logprob comes once, and each chunk validates against the official client's types."""

import json

import pytest
from openai.types.chat import ChatCompletionChunk

from verst.session.messages import parse_reply
from verst.session.openai_wire import TokenTexts, completion
from verst.session.streaming import ChunkStream, final_prefix

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("text, parse_tools, expected", [
    ("Hello wor", False, (None, "Hello wor")),
    ("Hello \ufffd", False, (None, "Hello ")),  # an incomplete character waits for its last byte
    ("Adding.\n<tool", True, (None, "Adding.")),  # what may begin a tool call, and the glue before it, wait
    ("Adding.\n" + CALL + " more", True, (None, "Adding.")),
    ("Adding.\n<tool", False, (None, "Adding.\n<tool")),  # without tools the text is the content
    (" Adding.", True, (None, "")),  # leading space: kept without a tool call, stripped with one
    ("<thi", True, (None, "")),
    ("<think>\nadd them\n</think>\n", False, (None, "")),  # newlines after the block may go on
    ("<think>\nadd them\n</think>\n\nIt is", False, ("add them", "It is")),
])
def test_final_prefix_is_what_no_later_text_can_change(text, parse_tools, expected):
    assert final_prefix(text, parse_tools) == expected


@pytest.mark.parametrize("text, parse_tools", [
    ("The sum is 3.", False),
    ("Adding now.\n" + CALL, True),
    (" Adding now.\n" + CALL, True),
    (" Just text, no call.", True),
    ("<think>\nOne plus two.\n</think>\n\n" + CALL, True),
    ("Broken <tool_call>\nnot json\n</tool_call> and more", True),
    ("caf\u00e9 \u4e2d\u6587", False),
])
def test_accumulated_deltas_are_the_parsed_reply(tok, text, parse_tools):
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    logprobs = [-(i + 1) / 10 for i in range(len(ids))]
    message = parse_reply(tok.decode(ids, skip_special_tokens=True), parse_tools)
    finish = "tool_calls" if message.get("tool_calls") else "stop"
    texts = TokenTexts(tok)
    reply = completion(completion_id="chatcmpl-r1", model="m", message=message, finish_reason=finish,
                       logprob_entries=texts.entries(ids, logprobs), n_out=len(ids), prompt_tokens=5,
                       cached_tokens=0, metadata={"session_id": "s", "turn": 0, "weight_version": "0"})
    stream = ChunkStream(tok, model="m", parse_tools=parse_tools, logprobs=True, include_usage=True, token_texts=texts)
    events = [e for n in range(1, len(ids) + 1) for e in stream.update("chatcmpl-r1", ids[:n], logprobs[:n])]
    events += stream.finish(reply)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate_json(e[len("data: "):], strict=True) for e in events[:-1]]
    *content_chunks, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == len(ids)
    deltas = [c.choices[0].delta for c in content_chunks]
    assert deltas[0].role == "assistant" and {c.id for c in chunks} == {"chatcmpl-r1"}
    assert "".join(d.content or "" for d in deltas) == (message["content"] or "")
    assert [getattr(d, "reasoning_content", None) for d in deltas if getattr(d, "reasoning_content", None)] == (
        [message["reasoning_content"]] if "reasoning_content" in message else [])
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.id, c.function.name) for c in calls] == [
        (i, call["id"], call["function"]["name"]) for i, call in enumerate(message.get("tool_calls") or [])]
    sent = [e.logprob for c in content_chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert sent == logprobs  # each output id's logprob once, in order
    assert [c.choices[0].finish_reason for c in content_chunks] == [None] * (len(content_chunks) - 1) + [finish]
    assert json.loads(events[-2][len("data: "):])["usage"]["prompt_tokens"] == 5
    if not parse_tools and "\u4e2d" not in text:
        assert len(content_chunks) > 2  # the content came token by token, not in one piece


def test_token_texts_show_each_ids_own_text_and_bytes_decoding_each_id_once(tok):
    ids = tok.encode("caf\u00e9 caf\u00e9 caf\u00e9", add_special_tokens=False) + [tok.eos_token_id]
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))]
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            decoded.append(ids[0])
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    entries = TokenTexts(Counting()).entries(ids, logprobs)
    assert [e["token"] for e in entries] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [bytes(e["bytes"]) for e in entries] == [tok.decode([i]).encode("utf-8") for i in ids]
    assert [e["logprob"] for e in entries] == logprobs
    assert sorted(decoded) == sorted(set(ids)) and len(set(ids)) < len(ids)
