"""Multi-turn SFT encoding: assistant turns (through their end-of-turn token) carry the loss, tool
results and template glue do not, and the ids are the template's text cut into turns."""

import random

import pytest

from verst.config import VerstConfig
from verst.data.calculator import CONVERSATION_KEY, calculator_problem
from verst.models.loader import render_chat
from verst.models.prompts import encode_prompt, encode_sft_conversation, encode_sft_example
from verst.schedules.sft import sft_sample
from verst.types import Sample


def problem(seed=0):
    text, label, meta = calculator_problem(random.Random(seed))
    return [{"role": "user", "content": text}], label, meta


def segments(tok, ids, mask):
    """The response as (text, flag) runs of equal mask values."""
    runs = []
    for token, flag in zip(ids, mask):
        if runs and runs[-1][1] == flag:
            runs[-1][0].append(token)
        else:
            runs.append(([token], flag))
    return [(tok.decode(t, skip_special_tokens=False), f) for t, f in runs]


def test_assistant_turns_carry_the_loss(tok):
    prompt, label, meta = problem()
    conversation, tools = meta[CONVERSATION_KEY], meta["tools"]
    ids, mask = encode_sft_conversation(tok, prompt, conversation, tools=tools)
    prompt_ids = encode_prompt(tok, prompt, tools=tools)
    assert ids[: len(prompt_ids)] == prompt_ids and len(ids) == len(prompt_ids) + len(mask)
    # the whole sequence is the template's rendering, ending at the last end-of-turn token
    full = render_chat(tok, prompt + conversation, tools=tools, add_generation_prompt=False)
    assert tok.decode(ids, skip_special_tokens=False) == full[: full.rindex(tok.eos_token) + len(tok.eos_token)]
    runs = segments(tok, ids[len(prompt_ids):], mask)
    assert [f for _, f in runs] == [1, 0, 1, 0, 1]
    first, second = conversation[0]["tool_calls"][0], conversation[2]["tool_calls"][0]
    assert runs[0][0] == f'<tool_call>\n{{"name": "calculator", "arguments": {first["function"]["arguments"]}}}\n' \
                         "</tool_call><|im_end|>"
    assert runs[1][0] == (f"\n<|im_start|>user\n<tool_response>\n{conversation[1]['content']}\n</tool_response>"
                          "<|im_end|>\n<|im_start|>assistant\n")
    assert second["function"]["arguments"] in runs[2][0]
    assert runs[4][0] == f"{label}<|im_end|>"


def test_one_reply_conversation_equals_the_single_turn_encoding(tok):
    prompt = [{"role": "user", "content": "12+34="}]
    ids, mask = encode_sft_conversation(tok, prompt, [{"role": "assistant", "content": "46"}])
    assert (ids, len(mask)) == encode_sft_example(tok, prompt, "46") and set(mask) == {1}


def test_system_prompt_and_text_prompt(tok):
    conversation = [{"role": "assistant", "content": "hi"}]
    ids, mask = encode_sft_conversation(tok, "hello", conversation, system_prompt="be brief")
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello")
    assert text.endswith("<|im_start|>assistant\nhi<|im_end|>") and sum(mask) == len(mask) == 3


def test_conversation_must_end_with_an_assistant_turn(tok):
    prompt, _, meta = problem()
    with pytest.raises(ValueError, match=r"must end with an assistant message; got roles \['assistant', 'tool'\]"):
        encode_sft_conversation(tok, prompt, meta[CONVERSATION_KEY][:2], tools=meta["tools"])


def test_a_template_that_rewrites_earlier_turns_is_refused(tok, monkeypatch):
    # renders only the last message: a later prefix does not extend an earlier one
    monkeypatch.setattr(tok, "chat_template", "{{ messages[-1].role }}: {{ messages[-1].content }}<|im_end|>"
                                              "{% if add_generation_prompt %}>{% endif %}")
    prompt, _, meta = problem()
    with pytest.raises(ValueError, match="not append-only at conversation message 0"):
        encode_sft_conversation(tok, prompt, meta[CONVERSATION_KEY])


def test_sft_sample_masks_tool_tokens(tok):
    prompt, label, meta = problem(1)
    row = Sample(prompt=prompt, label=label, metadata={**meta, "data_index": 0}, index=4, group_index=4)
    sample = sft_sample(tok, row, VerstConfig())
    assert 0 in sample.loss_mask and sample.loss_mask[0] == 1 and sample.loss_mask[-1] == 1
    assert len(sample.loss_mask) == sample.response_length == len(sample.rollout_logprobs)
    masked_out = [t for t, f in zip(sample.tokens[-sample.response_length:], sample.loss_mask) if not f]
    assert "<tool_response>" in tok.decode(masked_out, skip_special_tokens=False)
    with pytest.raises(ValueError, match="needs data.apply_chat_template = true"):
        sft_sample(tok, row, VerstConfig.model_validate({"data": {"apply_chat_template": False}}))
