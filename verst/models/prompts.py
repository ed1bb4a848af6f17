"""The text edge: a data prompt (text or chat messages) becomes prompt ids, and an SFT example (one
reply, or a multi-turn conversation with tool calls) becomes prompt + response ids ending at end of turn.
"""

from __future__ import annotations

from typing import Any

from verst.models.loader import render_chat

Prompt = str | list[dict[str, Any]]


def prompt_messages(prompt: Prompt, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Chat messages for a prompt: text becomes one user message; a system prompt goes first."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        messages = list(prompt)
    else:
        raise TypeError(f"prompt must be text or a list of chat messages, got {type(prompt).__name__}: {prompt!r:.80}")
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(
    tokenizer: Any,
    prompt: Prompt,
    *,
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Prompt ids: the chat template with the generation prompt, or, with the template disabled,
    the verbatim text of a text prompt or of a conversation that is a single user message.
    """
    if apply_chat_template:
        text = render_chat(tokenizer, prompt_messages(prompt, system_prompt), tools=tools, add_generation_prompt=True)
    else:
        text = _raw_text(prompt, system_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def _raw_text(prompt: Prompt, system_prompt: str | None) -> str:
    if system_prompt is not None:
        raise ValueError("data.system_prompt needs data.apply_chat_template = true")
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and prompt[0].get("role") == "user" and isinstance(prompt[0].get("content"), str):
        return prompt[0]["content"]
    roles = [m.get("role") for m in prompt]
    raise TypeError(f"data.apply_chat_template = false needs a text prompt or one user message, got roles {roles}")


def encode_sft_example(
    tokenizer: Any,
    prompt: Prompt,
    target: str,
    *,
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], int]:
    """(prompt + response ids, response_length) for imitating `target` as the assistant reply.

    The response is the assistant turn as the chat template renders it, cut right after the
    end-of-turn (eos) token: that is where generation stops, so the model learns to emit it and
    nothing the template adds after it.
    """
    prompt_ids = encode_prompt(
        tokenizer, prompt, apply_chat_template=apply_chat_template, system_prompt=system_prompt, tools=tools
    )
    eos = tokenizer.eos_token
    if apply_chat_template:
        messages = prompt_messages(prompt, system_prompt) + [{"role": "assistant", "content": target}]
        full = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=False)
        head = render_chat(tokenizer, messages[:-1], tools=tools, add_generation_prompt=True)
        if not full.startswith(head):
            raise ValueError("the chat template is not append-only for an assistant reply; cannot cut the response")
        reply = full[len(head) :]
        cut = reply.rfind(eos)
        if cut < 0:
            raise ValueError(f"the chat template's assistant turn {reply!r} does not contain the eos token {eos!r}")
        reply = reply[: cut + len(eos)]
    else:
        reply = target + eos
    response_ids = tokenizer.encode(reply, add_special_tokens=False)
    return prompt_ids + response_ids, len(response_ids)


def encode_sft_conversation(
    tokenizer: Any,
    prompt: Prompt,
    conversation: list[dict[str, Any]],
    *,
    system_prompt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """(prompt + response ids, response loss mask) for imitating a multi-turn `conversation` (the
    messages after the prompt: assistant turns, tool calls, tool results) with loss on assistant turns.

    The response is cut into segments by rendering growing prefixes of the conversation (the template
    must be append-only): each assistant turn, from after its generation prompt through its eos token,
    has mask 1 (what the model generates); everything between two assistant turns (the text after eos,
    tool results, the next generation prompt) has mask 0. Segments are tokenized separately, as a session
    server tokenizes appended messages, so the ids match what a rollout records. Ends at the last eos.
    """
    if not conversation or conversation[-1].get("role") != "assistant":
        roles = [m.get("role") for m in conversation]
        raise ValueError(f"an SFT conversation must end with an assistant message; got roles {roles}")
    messages = prompt_messages(prompt, system_prompt)
    eos = tokenizer.eos_token
    head = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(head, add_special_tokens=False)
    done = head  # the text encoded so far
    response: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(conversation):
        messages = messages + [message]
        if message.get("role") != "assistant":
            continue
        before = render_chat(tokenizer, messages[:-1], tools=tools, add_generation_prompt=True)
        full = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=False)
        if not before.startswith(done) or not full.startswith(before):
            raise ValueError(f"the chat template is not append-only at conversation message {i} "
                             f"(role {message.get('role')!r}); cannot cut the turns apart")
        turn = full[len(before):]
        cut = turn.rfind(eos)
        if cut < 0:
            raise ValueError(f"the chat template's assistant turn {turn!r:.120} does not contain the eos token {eos!r}")
        for text, flag in ((before[len(done):], 0), (turn[: cut + len(eos)], 1)):
            ids = tokenizer.encode(text, add_special_tokens=False) if text else []
            response += ids
            mask += [flag] * len(ids)
        done = before + turn[: cut + len(eos)]
    return prompt_ids + response, mask
