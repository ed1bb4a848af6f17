"""Template diffing at turn boundaries and the mismatch check, with verst's tiny chat template and two
Qwen-style ChatML templates with tools written here: one append-only, one that drops the reasoning of
replies before the last user message (as Qwen3's does), so it is NOT append-only."""

import asyncio

import pytest

from verst.inference_client.client import EngineClient
from verst.models.chat_template import TINY_CHAT_TEMPLATE
from verst.models.loader import load_tokenizer
from verst.models.tokenizer import save_tokenizer
from verst.session.manager import SessionManager
from verst.session.messages import parse_reply
from verst.session.scripted import ScriptedEngine
from verst.session.tito import ChatTemplate, TemplateError, check_conversation, compare_ids, mismatch_rates

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}

# A Qwen2.5/3-style ChatML template: tools in the system turn, consecutive tool results grouped into one
# user turn, reasoning in <think>. STRIP drops the reasoning of replies before the last user message.
QWEN_STYLE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions.\n\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nReturn each call within <tool_call></tool_call> tags.<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if m.reasoning_content is string and (KEEP or loop.index0 > ns.last_user) -%}
      {{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- m.content or '' -}}
    {%- for tc in m.tool_calls or [] -%}
      {%- if m.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' -}}
      {%- if tc.function.arguments is string -%}{{- tc.function.arguments -}}
      {%- else -%}{{- tc.function.arguments | tojson -}}{%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()
TEMPLATES = {
    "tiny": TINY_CHAT_TEMPLATE,
    "qwen_style": "{%- set KEEP = true -%}" + QWEN_STYLE,
    "qwen_style_strip": "{%- set KEEP = false -%}" + QWEN_STYLE,
}

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
# (reply text the model samples, messages the environment appends after it)
EPISODE = [
    ("<think>\nI should add.\n</think>\n\n" + CALL, [{"role": "tool", "content": "3", "tool_call_id": "c0"}]),
    ("Adding twice.\n" + CALL + "\n" + CALL, [{"role": "tool", "content": "3"}, {"role": "tool", "content": "3"}]),
    ("<think>\nDone.\n</think>\n\nThe sum is 3.", [{"role": "user", "content": "And 2+2?"}]),
    ("It is 4.", None),
]
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+2?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    out = {}
    for name, template in TEMPLATES.items():
        out[name] = load_tokenizer(save_tokenizer(tmp_path_factory.mktemp(name), template))
    return out


def play(template, episode=EPISODE, prompt=PROMPT, ended=True):
    """Run an episode the way the session server does: exact reply ids, only appended messages encoded.
    Returns (ids, model mask, messages)."""
    tok = template.tokenizer
    messages = [dict(m) for m in prompt]
    ids = template.prompt_ids(messages)
    mask = [0] * len(ids)
    for text, new in episode:
        out = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if ended else [])
        ids, mask = ids + out, mask + [1] * len(out)
        reply = parse_reply(text, parse_tools=bool(template.tools))
        messages.append(reply)
        if new is None:
            break
        env = template.append_ids(reply, new, ended=ended)
        ids, mask = ids + env, mask + [0] * len(env)
        messages += new
    return ids, mask, messages


@pytest.mark.parametrize("name", ["tiny", "qwen_style"])
def test_append_only_templates_accumulate_exactly_the_canonical_render(tokenizers, name):
    template = ChatTemplate(tokenizers[name], [ADD])
    ids, mask, messages = play(template)
    # the ids built turn by turn equal the whole conversation rendered and encoded at once
    canonical = template.encode(template.render(messages, add_generation_prompt=False))
    eos = tokenizers[name].eos_token_id
    assert ids + template.encode("\n") == canonical
    assert ids[-1] == eos and mask[-1] == 1
    assert check_conversation(template, messages, ids, mask, ended=True) == []


def test_the_glue_after_a_reply_is_the_templates_newline_and_the_new_turn(tokenizers):
    template = ChatTemplate(tokenizers["tiny"], None)
    reply = {"role": "assistant", "content": "4"}
    appended = template.append_ids(reply, [{"role": "user", "content": "ok"}], ended=True)
    assert template.tokenizer.decode(appended, skip_special_tokens=False) == (
        "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")
    # a reply cut by the length limit never sampled <|im_end|>: the template's closing is glue too
    cut = template.append_ids(reply, [{"role": "user", "content": "ok"}], ended=False)
    assert template.tokenizer.decode(cut, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n")


def test_qwen_style_groups_appended_tool_results_in_one_user_turn(tokenizers):
    template = ChatTemplate(tokenizers["qwen_style"], [ADD])
    reply = parse_reply(CALL, parse_tools=True)
    appended = template.append_ids(reply, [{"role": "tool", "content": "3"}, {"role": "tool", "content": "5"}], True)
    assert template.tokenizer.decode(appended, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n5\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_strips_earlier_reasoning_keeps_the_sampled_ids_and_reports_the_rewrite(tokenizers):
    strip = ChatTemplate(tokenizers["qwen_style_strip"], [ADD])
    ids, mask, messages = play(strip)
    # the trajectory is the same ids as under the append-only variant: what the model sampled
    keep_ids, _, _ = play(ChatTemplate(tokenizers["qwen_style"], [ADD]))
    assert ids == keep_ids
    # re-rendering drops the reasoning of the replies before the last user message: that text differs
    canonical = strip.encode(strip.render(messages, add_generation_prompt=False))
    assert canonical != ids + strip.encode("\n")
    found = check_conversation(strip, messages, ids, mask, ended=True)
    assert {m.kind for m in found} == {"assistant_text"}
    assert "I should add." in found[0].accumulated and "I should add." not in found[0].canonical


def test_appending_messages_that_rewrite_the_text_before_them_is_refused(tokenizers):
    # a header that counts the messages changes once a message is appended: no prefix to diff against
    tok = tokenizers["tiny"]
    counting = ChatTemplate(tok, None)
    original = tok.chat_template
    try:
        tok.chat_template = "{{ messages | length }}|" + TINY_CHAT_TEMPLATE
        with pytest.raises(TemplateError, match=r"not append-only for appended roles \['user'\].*char 0"):
            counting.append_ids({"role": "assistant", "content": "4"}, [{"role": "user", "content": "ok"}], True)
        # assistant turns that end without <|im_end|>: no place to join the sampled end-of-turn token
        tok.chat_template = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content -}}"
                             "{%- if m.role != 'assistant' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
                             "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
        with pytest.raises(TemplateError, match="does not end an assistant turn with the end-of-turn token"):
            counting.append_ids({"role": "assistant", "content": "4"}, [{"role": "user", "content": "ok"}], True)
    finally:
        tok.chat_template = original


def test_render_errors_are_bad_requests_naming_messages(tokenizers):
    template = ChatTemplate(tokenizers["tiny"], None)
    with pytest.raises(Exception) as err:
        template.prompt_ids([{"role": "robot", "content": "x"}])
    assert err.value.status == 400 and "unknown role robot" in err.value.message


# ---- classification ------------------------------------------------------------------------------
S, E = 900, 901  # two special ids


def classify(acc, canon, mask):
    return [m.kind for m in compare_ids(acc, canon, mask, {S, E}, lambda ids: " ".join(map(str, ids)))]


def test_mismatches_are_classified_by_special_tokens_then_text_span():
    acc = [S, 1, 2, E, S, 3, 4, E]
    mask = [0, 0, 0, 0, 0, 1, 1, 1]
    assert classify(acc, acc, mask) == []
    assert classify(acc, [S, 1, 2, E, 3, 4, E], mask) == ["special_token_count"]
    assert classify(acc, [S, 1, 2, S, S, 3, 4, E], mask) == ["special_token_type"]
    assert classify(acc, [S, 1, 9, E, S, 3, 4, E], mask) == ["non_assistant_text"]
    assert classify(acc, [S, 1, 2, E, S, 3, 5, 6, E], mask) == ["assistant_text"]
    assert classify(acc, [S, 7, E, S, 8, E], mask) == ["non_assistant_text", "assistant_text"]


def test_mismatch_position_and_texts_point_at_the_difference():
    found = compare_ids([S, 1, 2, E], [S, 1, 3, E], [0, 0, 1, 1], {S, E}, lambda ids: ",".join(map(str, ids)))
    assert [(m.kind, m.position, m.accumulated, m.canonical) for m in found] == [("assistant_text", 1, "1,2", "1,3")]


def test_mismatch_rates_are_fractions_of_trajectories():
    rates = mismatch_rates([[], ["assistant_text"], ["assistant_text", "special_token_count"], []])
    assert rates["rollout/tito_mismatch_rate/assistant_text"] == 0.5
    assert rates["rollout/tito_mismatch_rate/special_token_count"] == 0.25
    assert rates["rollout/tito_mismatch_rate/non_assistant_text"] == 0.0
    assert rates["rollout/tito_mismatch_rate/any"] == 0.5
    assert mismatch_rates([]) == {}


def test_the_session_server_on_a_reasoning_stripping_template_trains_on_the_sampled_ids(tokenizers):
    """What the session server does with a template that is not append-only: it joins the engine's ids and
    the new messages' ids as always; the re-render check reports the rewritten reasoning in the sample
    and the metrics; the sample keeps the ids the model sampled."""
    tok = tokenizers["qwen_style_strip"]
    engine = ScriptedEngine(tok, ["<think>\nsmall sum\n</think>\n\n3", "<think>\nagain\n</think>\n\n4"])
    second_user = {"role": "user", "content": "And 2+2?"}

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            m = SessionManager(client, tok)
            sid = m.create()
            first = await m.chat_completion(sid, {"messages": PROMPT})
            reply = first["choices"][0]["message"]
            assert reply == {"role": "assistant", "reasoning_content": "small sum", "content": "3"}
            await m.chat_completion(sid, {"messages": [*PROMPT, reply, second_user]})
            return m.samples(sid)[0], m.metrics()

    sample, metrics = asyncio.run(main())
    c0, c1 = engine.calls
    user_ids = tok.encode("\n<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert c1.input_ids == c0.input_ids + c0.output_ids + user_ids
    assert sample.tokens == c1.input_ids + c1.output_ids  # the sampled reasoning of turn 1 stays in
    assert "small sum" in tok.decode(sample.tokens)
    (found,) = sample.metadata["tito_mismatch"]
    assert found["kind"] == "assistant_text" and "small sum" in found["accumulated"]
    assert "small sum" not in found["canonical"]
    assert metrics["rollout/tito_mismatch_rate/assistant_text"] == 1.0
    assert metrics["rollout/tito_mismatch_rate/special_token_count"] == 0.0
