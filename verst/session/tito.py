"""Token-in-token-out across turns: the ids of newly appended chat messages, found by diffing chat-template
renders, and the check of a trajectory's accumulated ids against a canonical re-render, classified.

A finished turn is never re-tokenized: its ids are the engine's. Only the text a template adds after it
(the end of the assistant turn, the new messages, the next generation prompt) is encoded.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jinja2

from verst.models.loader import render_chat
from verst.session.errors import SessionError

MISMATCH_TYPES = ("special_token_count", "special_token_type", "non_assistant_text", "assistant_text")
METRIC_PREFIX = "rollout/tito_mismatch_rate/"
# The appended messages are rendered after a stand-in context [user, the last reply] rather than after the
# whole history: templates that rewrite earlier turns once a new one arrives (Qwen3 drops the reasoning of
# replies before the last user message) would otherwise leave no common prefix to diff against. What
# such a rewrite changes is not lost: the canonical re-render check below reports it.
_STANDIN_USER = {"role": "user", "content": "verst-standin-context"}


class TemplateError(SessionError):
    """The chat template cannot be diffed at a turn boundary; the message shows the texts."""

    def __init__(self, message: str):
        super().__init__(400, message, "messages")


@dataclasses.dataclass
class ChatTemplate:
    """One tokenizer's chat template with a session's tools and template kwargs fixed."""

    tokenizer: Any
    tools: list[dict[str, Any]] | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return render_chat(self.tokenizer, messages, tools=self.tools or None,
                               add_generation_prompt=add_generation_prompt, **self.kwargs)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise SessionError(400, f"messages: the chat template cannot render them ({exc})", "messages") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    @property
    def end_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """First turn: the whole conversation rendered with the generation prompt, encoded once."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def append_ids(self, last_reply: dict[str, Any], new: list[dict[str, Any]], ended: bool) -> list[int]:
        """Ids that follow a trajectory whose last ids are the sampled reply `last_reply`: the template's
        end of that assistant turn (`ended`: the model sampled the end-of-turn token itself, so only what
        the template writes after it, e.g. Qwen's '\\n', is added), then the new messages and the next
        generation prompt."""
        context = [_STANDIN_USER, _standin_reply(last_reply)]
        head = self.render(context, add_generation_prompt=False)
        full = self.render(context + new, add_generation_prompt=True)
        if not full.startswith(head):
            at = _common_prefix(head, full)
            raise TemplateError(
                f"chat template is not append-only for appended roles {[m['role'] for m in new]}: rendering them "
                f"changes the text before them at char {at} ({head[at:at + 40]!r} -> {full[at:at + 40]!r})"
            )
        return self.encode(self._turn_end(head, ended) + full[len(head):])

    def closing_ids(self, last_reply: dict[str, Any], ended: bool) -> list[int]:
        """Ids the template writes after the last reply when the conversation ends there."""
        return self.encode(self._turn_end(self.render([_STANDIN_USER, _standin_reply(last_reply)], False), ended))

    @functools.cached_property
    def _standin_prompt(self) -> str:
        """The stand-in user message with the generation prompt: the same text every turn of a session."""
        return self.render([_STANDIN_USER], add_generation_prompt=True)

    def _turn_end(self, head: str, ended: bool) -> str:
        """The text after the reply's sampled ids in `head`, a render that ends with that reply."""
        end = self.tokenizer.eos_token
        # the reply starts where `head` leaves the stand-in prompt (with its generation prompt)
        reply_start = _common_prefix(head, self._standin_prompt)
        at = head.rfind(end) if end else -1
        if at < reply_start:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the end-of-turn token {end!r} "
                f"(it renders {head[reply_start:][-60:]!r}); the session server joins turns at that token"
            )
        return head[at + len(end):] if ended else head[at:]


def _standin_reply(reply: dict[str, Any]) -> dict[str, Any]:
    # Without reasoning: templates may drop it from earlier turns, and the text after the turn is the same.
    return {k: v for k, v in reply.items() if k != "reasoning_content"}


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ---- the mismatch check ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Where the accumulated ids and the canonical re-render part, and how (one of MISMATCH_TYPES)."""

    kind: str
    position: int  # index into the accumulated ids
    accumulated: str
    canonical: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compare_ids(
    accumulated: Sequence[int], canonical: Sequence[int], model_mask: Sequence[int], special_ids: set[int],
    decode: Callable[[list[int]], str],
) -> list[Mismatch]:
    """Classify how `accumulated` (mask 1 on model-sampled ids) differs from `canonical`: by the number of
    special tokens, then their types, then each text span between them (inside a span holding model
    tokens: assistant_text, else non_assistant_text). Empty when equal."""
    if list(accumulated) == list(canonical):
        return []
    specials_a = [i for i, t in enumerate(accumulated) if t in special_ids]
    specials_c = [i for i, t in enumerate(canonical) if t in special_ids]
    at = _common_prefix(list(accumulated), list(canonical))  # type: ignore[arg-type]

    def show(ids: Sequence[int], start: int) -> str:
        return decode(list(ids[start:start + 24]))

    if len(specials_a) != len(specials_c):
        return [Mismatch("special_token_count", at, show(accumulated, at), show(canonical, at))]
    types_a, types_c = [accumulated[i] for i in specials_a], [canonical[i] for i in specials_c]
    if types_a != types_c:
        j = next(k for k in range(len(types_a)) if types_a[k] != types_c[k])
        return [Mismatch("special_token_type", specials_a[j], show(accumulated, specials_a[j]),
                         show(canonical, specials_c[j]))]
    found = []
    bounds_a = [-1, *specials_a, len(accumulated)]
    bounds_c = [-1, *specials_c, len(canonical)]
    for k in range(len(bounds_a) - 1):
        a0, a1, c0, c1 = bounds_a[k] + 1, bounds_a[k + 1], bounds_c[k] + 1, bounds_c[k + 1]
        if list(accumulated[a0:a1]) != list(canonical[c0:c1]):
            kind = "assistant_text" if any(model_mask[a0:a1]) else "non_assistant_text"
            shown = decode(list(accumulated[a0:a1]))[:120], decode(list(canonical[c0:c1]))[:120]
            found.append(Mismatch(kind, a0, *shown))
    return found


def check_conversation(
    template: ChatTemplate, messages: list[dict[str, Any]], ids: Sequence[int], model_mask: Sequence[int], ended: bool,
) -> list[Mismatch]:
    """The accumulated `ids` of a conversation that ends with a sampled reply (`ended`: it sampled the
    end-of-turn token), plus the template's closing of that turn, against the whole `messages` rendered
    and encoded at once."""
    closing = template.closing_ids(messages[-1], ended)
    canonical = template.encode(template.render(messages, add_generation_prompt=False))
    tokenizer = template.tokenizer
    return compare_ids(list(ids) + closing, canonical, list(model_mask) + [0] * len(closing),
                       set(tokenizer.all_special_ids), lambda t: tokenizer.decode(t, skip_special_tokens=False))


def mismatch_rates(kinds_per_trajectory: Sequence[Sequence[str]]) -> dict[str, float]:
    """`rollout/tito_mismatch_rate/<type>`: the fraction of trajectories with at least one mismatch of that
    type (and `/any`); empty for no trajectories."""
    if not kinds_per_trajectory:
        return {}
    rates = {METRIC_PREFIX + kind: statistics.fmean(kind in kinds for kinds in kinds_per_trajectory)
             for kind in MISMATCH_TYPES}
    rates[METRIC_PREFIX + "any"] = statistics.fmean(bool(kinds) for kinds in kinds_per_trajectory)
    return rates
