"""The session server's logic, without HTTP: sessions that own one multi-turn trajectory each, keep the exact
ids the engines sampled, tokenize only newly appended messages, and report re-tokenization mismatches.

Every engine request carries the session id as its routing key, so a router pins the session to the
engine that holds its prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from verst.inference_client.client import EngineClient, EngineError, GenerateResult
from verst.session.assemble import ERROR_KEY, FINISH_STATUS, Trajectory, assemble
from verst.session.continued import OnTokens, after, joined, token_versions
from verst.session.errors import SessionError
from verst.session.messages import check_tool_results, first_difference, parse_reply
from verst.session.openai_wire import OPENAI_NAMES, ChatRequest, TokenTexts, completion, parse_request
from verst.session.tito import METRIC_PREFIX, MISMATCH_TYPES, ChatTemplate, check_conversation
from verst.types import Sample

OnRequest = Callable[[str, bool], None]
"""`on_request(rid, started)`: called before (True) and after (False) each engine request of a session."""
Stopped = Callable[[], bool]
"""`stopped()`: whether the session's episode was stopped from outside (its aborts are then that stop)."""
logger = logging.getLogger(__name__)
_ENGINE_FIELD = re.compile(r"sampling_params\.\w+")
_URL = re.compile(r"https?://[^\s'\")]+")  # an engine's or router's address inside an error message
MISMATCH_KEY = "tito_mismatch"  # sample.metadata: the mismatches of the canonical re-render check


@dataclasses.dataclass
class Session:
    id: str
    metadata: dict[str, Any]
    on_request: OnRequest | None
    stopped: Stopped | None = None
    created: float = dataclasses.field(default_factory=time.time)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # history incl. the server's replies
    trajectory: Trajectory = dataclasses.field(default_factory=Trajectory)
    template: ChatTemplate | None = None  # fixed by the first turn: its tools and template kwargs
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one turn at a time
    rollbacks: int = 0
    ended: str | None = None  # why no further turn is accepted
    checked: bool = False  # the mismatch check has been counted in the metrics (once per session)
    deleted: bool = False


@dataclasses.dataclass
class _Plan:
    """How a request extends a session; applied only once the engine has answered."""

    template: ChatTemplate
    env_ids: list[int]  # ids to join after the kept trajectory: prompt, or template glue + new messages
    n_kept: int  # stored messages the request keeps (authoritative over their resent copies)
    rollback: bool  # the request retries the last turn: drop it first


class SessionManager:
    """Sessions by id. `chat_completion` runs one turn; `samples` assembles a session into Samples.

    `max_context_tokens` caps prompt + response of a trajectory (each turn's max_new_tokens is cut to the
    room left); `max_new_tokens` is the per-turn default when a request names none; `default_sampling`
    holds SGLang sampling_params that requests override field by field. `context_length` is the model's
    context (prompt + completion of one engine request); None: the engine's `/get_model_info` tells it.
    `partial_rollout`: a turn's engine call that a weight update aborted goes on inside the turn with the new
    weights (input ids + the output so far, the rest of the budget), and each output id's version is recorded.
    """

    def __init__(self, engine: EngineClient, tokenizer: Any, *, max_context_tokens: int | None = None,
                 max_new_tokens: int = 256, default_sampling: dict[str, Any] | None = None, model_name: str = "verst",
                 context_length: int | None = None, partial_rollout: bool = False):
        if max_context_tokens is not None and max_context_tokens < 2:
            raise ValueError(f"SessionManager: max_context_tokens = {max_context_tokens} must be >= 2")
        if max_new_tokens < 1:
            raise ValueError(f"SessionManager: max_new_tokens = {max_new_tokens} must be >= 1")
        self.engine, self.tokenizer = engine, tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.max_context_tokens, self.max_new_tokens = max_context_tokens, max_new_tokens
        self.default_sampling = dict(default_sampling or {})
        self.default_sampling.pop("max_new_tokens", None)
        self.model_name, self.created = model_name, int(time.time())
        self.context_length, self.partial_rollout = context_length, partial_rollout
        self._context_asked = False  # the engine was asked for its context length (it may not report one)
        self._sessions: dict[str, Session] = {}
        self._rid_counter = itertools.count()
        self._checked = 0
        self._mismatch_counts = dict.fromkeys(MISMATCH_TYPES, 0)
        self._mismatched = 0

    # ---- lifecycle --------------------------------------------------------------------------------
    def create(self, metadata: dict[str, Any] | None = None, *, on_request: OnRequest | None = None,
               stopped: Stopped | None = None) -> str:
        """A new empty session; its id (also the routing key of its engine requests). `stopped` tells whether
        its caller ended the episode: an abort then is never continued, whatever its message says."""
        session = Session(uuid.uuid4().hex, dict(metadata or {}), on_request, stopped)
        self._sessions[session.id] = session
        return session.id

    def get(self, session_id: str) -> dict[str, Any]:
        """A JSON view of the session: history, tools, token counts and one record per turn."""
        s = self._session(session_id)
        turns = s.trajectory.turns
        return {
            "session_id": s.id, "metadata": s.metadata, "created": s.created, "messages": s.messages,
            "tools": s.template.tools if s.template else None, "n_tokens": len(s.trajectory.ids),
            "n_prompt_tokens": turns[0].out_start if turns else 0, "turns": [t.to_dict() for t in turns],
            "finish_reasons": [t.finish_reason for t in turns], "rollbacks": s.rollbacks, "ended": s.ended,
            "truncated": s.trajectory.truncated,
        }

    def delete(self, session_id: str) -> None:
        self._session(session_id).deleted = True
        del self._sessions[session_id]

    def __len__(self) -> int:
        return len(self._sessions)

    def _session(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"unknown session {session_id!r} (never created, or deleted)", "session_id")
        return session

    # ---- one turn ---------------------------------------------------------------------------------
    async def chat_completion(self, session_id: str, request: dict[str, Any],
                              on_tokens: OnTokens | None = None) -> dict[str, Any]:
        """One OpenAI chat completion in a session: the request must extend the session's history (or
        retry its last turn); the reply is recorded with the exact ids and logprobs the engine sent.
        `on_tokens` given: the engine streams the turn and sees each update (the recorded ids are the same)."""
        session = self._session(session_id)
        req = parse_request(request)
        check_tool_results(req.messages, session.messages)
        context_length = await self._context_length()
        async with session.lock:
            if session.ended:
                raise SessionError(400, f"session {session_id}: {session.ended}; it takes no further turns", "messages")
            plan = self._plan(session, req)
            trajectory = session.trajectory
            n_kept = trajectory.turns[-1].env_start if plan.rollback else len(trajectory.ids)
            input_ids = trajectory.ids[:n_kept] + plan.env_ids
            max_new = self._budget(req, len(input_ids), context_length)
            if max_new == 0:
                return self._context_full(session, req, len(input_ids))
            calls = await self._generate(session, input_ids, {**self.default_sampling, **req.sampling,
                                                              "max_new_tokens": max_new}, on_tokens)
            if session.deleted:
                raise SessionError(404, f"session {session_id} was deleted while its turn was generating", "session_id")
            return self._commit(session, req, plan, calls, len(input_ids))

    def _plan(self, session: Session, req: ChatRequest) -> _Plan:
        stored, turns = session.messages, session.trajectory.turns
        if not turns:
            return self._first_turn(req, rollback=False)
        diff = first_difference(stored, req.messages)
        if diff is None:
            return self._next_turn(session, req, stored, len(turns) - 1, rollback=False)
        # One-step rollback: the agent resends the history as it was before the last reply.
        last = turns[-1]
        base = stored[:last.n_messages_before]
        reply_at = len(stored) - 1
        retried = first_difference(base, req.messages) is None and not (
            len(req.messages) > reply_at and req.messages[reply_at]["role"] == "assistant")
        if not retried:
            theirs = req.messages[diff] if diff < len(req.messages) else None
            raise SessionError(
                400, f"messages[{diff}] differs from the session history (stored {_brief(stored[diff])}, "
                     f"got {_brief(theirs)}); a request must extend the history, replies of this session included, "
                     f"or retry only the last turn", f"messages[{diff}]")
        if len(turns) == 1:
            return self._first_turn(req, rollback=True)
        return self._next_turn(session, req, base, len(turns) - 2, rollback=True)

    def _first_turn(self, req: ChatRequest, rollback: bool) -> _Plan:
        template = ChatTemplate(self.tokenizer, req.tools, req.template_kwargs)
        ids = template.prompt_ids(req.messages)
        if self.max_context_tokens is not None and len(ids) >= self.max_context_tokens:
            raise SessionError(400, f"messages: the prompt has {len(ids)} tokens; max_context_tokens = "
                                    f"{self.max_context_tokens} leaves no room to generate", "messages")
        return _Plan(template, ids, 0, rollback)

    def _next_turn(self, session: Session, req: ChatRequest, history: list[dict], after_turn: int,
                   rollback: bool) -> _Plan:
        template = session.template
        assert template is not None  # set by the first turn
        if (req.tools or None) != template.tools or req.template_kwargs != template.kwargs:
            raise SessionError(400, "tools and chat_template_kwargs must stay as the session's first turn set them "
                                    f"(tools {_names(template.tools)} -> {_names(req.tools)}, chat_template_kwargs "
                                    f"{template.kwargs} -> {req.template_kwargs})", "tools")
        new = req.messages[len(history):]
        if not new:
            raise SessionError(400, f"messages end with the session's last reply (messages[{len(history) - 1}]); "
                                    "append a user or tool message", "messages")
        for i, m in enumerate(new, start=len(history)):
            if m["role"] == "assistant":
                raise SessionError(400, f"messages[{i}] is an assistant message this session did not produce; "
                                        "later turns may append only user, tool and system messages", f"messages[{i}]")
        ended = session.trajectory.sampled_end(after_turn, self.tokenizer.eos_token_id)
        return _Plan(template, template.append_ids(history[-1], new, ended), len(history), rollback)

    def _budget(self, req: ChatRequest, n_input: int, context_length: int | None) -> int:
        """The turn's max_new_tokens: the request's (else the default), cut to the room max_context_tokens
        leaves (0: none). A request asking for more than a context holds is refused, as OpenAI and SGLang
        do; the default is cut to the model's context instead."""
        field, asked = req.max_tokens_field, req.max_tokens
        if asked is not None and self.max_context_tokens is not None and asked >= self.max_context_tokens:
            raise SessionError(400, f"{field} = {asked} exceeds the session's context: max_context_tokens = "
                                    f"{self.max_context_tokens} holds the messages and the completion together; "
                                    f"lower {field}", field)
        want = asked or self.max_new_tokens
        if self.max_context_tokens is not None:
            want = max(0, min(want, self.max_context_tokens - n_input))
        if context_length is None or want == 0 or n_input + want <= context_length:
            return want
        if asked is None:
            if n_input < context_length:
                return context_length - n_input
            raise SessionError(400, f"messages: the prompt has {n_input} tokens; the model's maximum context length "
                                    f"of {context_length} tokens leaves no room to generate", "messages")
        raise SessionError(400, f"{field} = {want} exceeds the context: the model's maximum context length is "
                                f"{context_length} tokens and this request asks for {n_input + want} ({n_input} in "
                                f"the messages, {want} in the completion); lower {field} or shorten the messages",
                           field)

    async def _context_length(self) -> int | None:
        """The model's context: as given, else as the engine reports it (asked until it answers once;
        None when it does not say, as SGLang, which then refuses an oversized request itself)."""
        if self.context_length is None and not self._context_asked:
            try:
                info = await self.engine.get_model_info()
            except EngineError as exc:
                logger.warning("the engine did not tell its context length (%s); requests go unchecked", exc)
                # a refusal (4xx) is the engine's answer for good; an engine away is asked again next turn
                self._context_asked = exc.status is not None and exc.status < 500
                return None
            self._context_asked = True
            value = info.get("context_length") if isinstance(info, dict) else None
            self.context_length = int(value) if value else None
        return self.context_length

    def _context_full(self, session: Session, req: ChatRequest, n_input: int) -> dict[str, Any]:
        """No room for another turn: the trajectory ends TRUNCATED and the agent is told `length`."""
        session.trajectory.truncated = (f"the next turn's prompt has {n_input} tokens, no room under "
                                        f"max_context_tokens = {self.max_context_tokens}")
        session.ended = "the trajectory reached max_context_tokens"
        message = {"role": "assistant", "content": ""}
        return completion(completion_id=f"chatcmpl-{session.id}-full", model=req.model or self.model_name,
                          message=message, finish_reason="length", logprob_entries=[] if req.logprobs else None,
                          n_out=0, prompt_tokens=n_input, cached_tokens=0, metadata={"session_id": session.id})

    async def _generate(self, session: Session, input_ids: list[int], params: dict[str, Any],
                        on_tokens: OnTokens | None = None) -> list[GenerateResult]:
        """The turn's engine calls: one, and with partial rollouts one more after each weight update that
        aborted the last, sent the input ids + the output so far with the rest of the budget (tokens in,
        tokens out). A streamed continuation reports the whole turn's output so far, the ids streamed first."""
        budget = params["max_new_tokens"]
        calls = [await self._call(session, input_ids, params, on_tokens)]
        while self._continues(session, calls[-1]) and (n := sum(len(c.output_ids) for c in calls)) < budget:
            so_far = joined(calls)
            streamed = None if on_tokens is None else after(so_far, on_tokens)
            calls.append(await self._call(session, input_ids + so_far.output_ids,
                                          {**params, "max_new_tokens": budget - n}, streamed))
        return calls

    def _continues(self, session: Session, result: GenerateResult) -> bool:
        """A weight update aborted the call, not the caller's stop (SGLang's abort by rid reads the same)."""
        return (self.partial_rollout and result.aborted_for_weight_update and not session.deleted
                and not (session.stopped is not None and session.stopped()))

    async def _call(self, session: Session, input_ids: list[int], params: dict[str, Any],
                    on_tokens: OnTokens | None) -> GenerateResult:
        rid = f"session-{session.id}-{next(self._rid_counter)}"
        if session.on_request is not None:
            session.on_request(rid, True)
        try:
            if on_tokens is None:
                result = await self.engine.generate(input_ids, params, rid=rid, return_logprob=True,
                                                    routing_key=session.id)
            else:
                result = None
                async for result in self.engine.generate_stream(input_ids, params, rid=rid, routing_key=session.id):
                    on_tokens(result)
                if result is None:
                    raise EngineError("/generate", 502, "the engine's stream ended without a reply")
        except EngineError as exc:
            raise _engine_error(exc) from None
        finally:
            if session.on_request is not None:
                session.on_request(rid, False)
        n = len(result.output_ids)
        if result.logprobs is None or len(result.logprobs) != n or result.finish_reason not in FINISH_STATUS:
            got = None if result.logprobs is None else len(result.logprobs)
            raise SessionError(502, f"engine reply for rid {rid!r} is unusable: {got} logprobs for {n} output ids, "
                                    f"finish_reason {result.finish_reason!r}", "engine")
        return result

    def _commit(self, session: Session, req: ChatRequest, plan: _Plan, calls: list[GenerateResult],
                n_input: int) -> dict[str, Any]:
        trajectory = session.trajectory
        if plan.rollback:
            trajectory.rollback()
            session.rollbacks += 1
        kept = session.messages[:plan.n_kept]
        result = joined(calls)
        turn = trajectory.add_turn(plan.env_ids, result.output_ids, result.logprobs or [], result.finish_reason,
                                   calls[0].oldest_weight_version, prompt_tokens=result.prompt_tokens,
                                   cached_tokens=result.cached_tokens, n_messages_before=len(kept),
                                   later_versions=[c.oldest_weight_version for c in calls[1:]],
                                   token_versions=token_versions(calls) if self.partial_rollout else None)
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        reply = parse_reply(text, req.parse_tools)
        session.template = plan.template
        session.messages = kept + req.messages[plan.n_kept:] + [reply]
        trajectory.truncated = None
        finish = result.finish_reason
        if finish == "abort":
            reason = (result.meta_info.get("finish_reason") or {}).get("message") or "no message"
            session.ended = f"turn {len(trajectory.turns) - 1} was aborted by the engine ({reason})"
        elif finish == "stop" and reply.get("tool_calls"):
            finish = "tool_calls"
        entries = self.token_texts.entries(result.output_ids, turn.logprobs) if req.logprobs else None
        return completion(
            completion_id=f"chatcmpl-{result.rid or session.id}", model=req.model or self.model_name, message=reply,
            finish_reason=finish, logprob_entries=entries, n_out=len(turn.logprobs), prompt_tokens=n_input,
            cached_tokens=result.cached_tokens,
            metadata={"session_id": session.id, "turn": len(trajectory.turns) - 1,
                      "weight_version": result.weight_version},
        )

    # ---- assembly and the mismatch check --------------------------------------------------------------
    def samples(self, session_id: str, max_tokens: int | None = None) -> list[Sample]:
        """The session as one Sample (truncated at turn boundaries to `max_tokens`, default
        max_context_tokens), with the re-render check in metadata['tito_mismatch']."""
        session = self._session(session_id)
        limit = max_tokens if max_tokens is not None else self.max_context_tokens
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        sample = assemble(session.trajectory, max_tokens=limit, decode=decode)
        meta = sample.metadata
        meta.update(session_id=session.id, rollbacks=session.rollbacks, messages=list(session.messages))
        if session.trajectory.turns:
            self._check(session, meta)
        if session.ended and ERROR_KEY not in meta:
            meta[ERROR_KEY] = session.ended
        return [sample]

    def _check(self, session: Session, meta: dict[str, Any]) -> None:
        """The canonical re-render check into `meta`, counted in the metrics at a session's first assembly.
        A conversation the template cannot re-render is reported, not fatal: training uses the ids anyway."""
        trajectory = session.trajectory
        assert session.template is not None  # set by the first turn
        ended = trajectory.sampled_end(len(trajectory.turns) - 1, self.tokenizer.eos_token_id)
        try:
            mismatches = check_conversation(session.template, session.messages, trajectory.ids,
                                            trajectory.model_mask(), ended)
        except SessionError as exc:
            meta[MISMATCH_KEY + "_error"] = exc.message
            return
        meta[MISMATCH_KEY] = [m.to_dict() for m in mismatches]
        if not session.checked:
            session.checked = True
            self._count({m.kind for m in mismatches})

    def _count(self, kinds: set[str]) -> None:
        self._checked += 1
        self._mismatched += bool(kinds)
        for kind in kinds:
            self._mismatch_counts[kind] += 1

    def metrics(self) -> dict[str, float]:
        """`rollout/tito_mismatch_rate/<type>` (and `/any`): the fraction of the sessions assembled so far
        (each counted at its first assembly) whose accumulated ids differ from a canonical re-render in
        that way; `rollout/tito_checked_sessions`: how many."""
        rates = {METRIC_PREFIX + kind: n / self._checked if self._checked else 0.0
                 for kind, n in self._mismatch_counts.items()}
        rates[METRIC_PREFIX + "any"] = self._mismatched / self._checked if self._checked else 0.0
        rates["rollout/tito_checked_sessions"] = float(self._checked)
        return rates


def _engine_error(exc: EngineError) -> SessionError:
    """The engine's failure as the agent's error: a refused parameter (4xx) is the client's, named by the
    field the engine gave, anything else is the engine's (502). The engine's address stays in the log."""
    logger.warning("engine request failed: %s", exc)
    message = _URL.sub("<engine>", exc.message)
    if exc.status is not None and 400 <= exc.status < 500:
        field = "body"
        # the engine's name for the field (sampling_params.temperature), from its error body or message
        named = exc.field or (m.group(0) if (m := _ENGINE_FIELD.match(message)) else None)
        if named:
            key = named.removeprefix("sampling_params.")
            field = OPENAI_NAMES.get(key, key)
            message = field + message[len(named):] if message.startswith(named) else message
        return SessionError(400, f"the engine refused the request ({exc.status}): {message}", field)
    status = "no reply" if exc.status is None else f"status {exc.status}"
    return SessionError(502, f"engine request failed ({status}): {message}", "engine")


def _brief(message: dict[str, Any] | None) -> str:
    if message is None:
        return "nothing"
    calls = [c["function"]["name"] for c in message.get("tool_calls") or []]
    return f"{message['role']} {str(message.get('content') or '')[:40]!r}" + (f" calling {calls}" if calls else "")


def _names(tools: list[dict] | None) -> list[str] | None:
    if tools is None:
        return None
    return [str((t.get("function") or t).get("name")) for t in tools]
