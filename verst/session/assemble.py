"""A multi-turn trajectory as the engine produced it (accumulated ids, one record per engine call) and its
assembly into one `Sample`: loss mask 1 on sampled ids, 0 on prompt, tool and template ids.

Shared by the session server and the direct multi-turn generate fn, so both record turns the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from verst.types import Sample, Status

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
ERROR_KEY = "session_error"  # sample.metadata: why the trajectory could not be assembled or was cut


@dataclasses.dataclass
class Turn:
    """One reply: an engine call, and with partial rollouts one more after each weight update that aborted
    the last. ids[env_start:out_start] came from the environment and the template (for the first turn: the
    prompt); ids[out_start:out_end] are the engine's output ids, joined across its calls."""

    env_start: int
    out_start: int
    logprobs: list[float]
    finish_reason: str  # stop | length | abort (the last call's)
    weight_version: str  # the oldest weights behind the first call's tokens
    prompt_tokens: int  # what the engine reported it was sent (every call's)
    cached_tokens: int
    n_messages_before: int  # messages of the history before this turn's request
    later_versions: list[str] = dataclasses.field(default_factory=list)  # the continuing calls', one each
    token_versions: list[int] | None = None  # per output id: the version that sampled it; None: not recorded

    @property
    def continued(self) -> int:
        """Engine calls that went on after a weight update aborted the one before."""
        return len(self.later_versions)

    @property
    def out_end(self) -> int:
        return self.out_start + len(self.logprobs)

    def to_dict(self) -> dict[str, Any]:
        return {"finish_reason": self.finish_reason, "weight_version": self.weight_version,
                "env_tokens": self.out_start - self.env_start, "output_tokens": len(self.logprobs),
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "continued": self.continued}


@dataclasses.dataclass
class Trajectory:
    """Accumulated ids of one conversation and the turns that produced them (append-only between rollbacks)."""

    ids: list[int] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    truncated: str | None = None  # why the conversation stopped at the context limit after its last turn

    def add_turn(self, env_ids: list[int], output_ids: list[int], logprobs: list[float], finish_reason: str,
                 weight_version: str, *, prompt_tokens: int = 0, cached_tokens: int = 0,
                 n_messages_before: int = 0, later_versions: list[str] | None = None,
                 token_versions: list[int] | None = None) -> Turn:
        """Join `env_ids` (new prompt or environment ids) and the engine's output after the stored ids.
        `later_versions`: those of the calls that continued the turn; `token_versions`: one per output id."""
        if len(logprobs) != len(output_ids):
            raise ValueError(f"turn {len(self.turns)}: {len(logprobs)} logprobs for {len(output_ids)} output ids")
        if token_versions is not None and len(token_versions) != len(output_ids):
            raise ValueError(f"turn {len(self.turns)}: {len(token_versions)} token versions for {len(output_ids)} "
                             "output ids")
        if finish_reason not in FINISH_STATUS:
            raise ValueError(f"turn {len(self.turns)}: finish_reason {finish_reason!r} is not one of "
                             f"{sorted(FINISH_STATUS)}")
        turn = Turn(len(self.ids), len(self.ids) + len(env_ids), list(logprobs), finish_reason, str(weight_version),
                    prompt_tokens, cached_tokens, n_messages_before, [str(v) for v in later_versions or []],
                    None if token_versions is None else list(token_versions))
        self.ids += list(env_ids) + list(output_ids)
        self.turns.append(turn)
        return turn

    def rollback(self) -> Turn:
        """Drop the last turn (its environment ids and output); return it."""
        turn = self.turns.pop()
        del self.ids[turn.env_start:]
        return turn

    def sampled_end(self, index: int, end_token_id: int) -> bool:
        """Whether turn `index` ended with the end-of-turn token it sampled (else the template closes it)."""
        turn = self.turns[index]
        return turn.out_end > turn.out_start and self.ids[turn.out_end - 1] == end_token_id

    def model_mask(self) -> list[int]:
        """1 on engine-sampled ids, 0 elsewhere; aligned with `ids`."""
        mask = [0] * len(self.ids)
        for turn in self.turns:
            mask[turn.out_start:turn.out_end] = [1] * len(turn.logprobs)
        return mask


def assemble(
    trajectory: Trajectory, *, max_tokens: int | None = None, decode: Callable[[list[int]], str] | None = None
) -> Sample:
    """One Sample: tokens = the first prompt + every later turn's environment ids and output ids, cut at
    a turn boundary so it fits `max_tokens`. Status: ABORTED if any kept turn was aborted, else from
    the last kept turn's finish reason (stop -> COMPLETED, length -> TRUNCATED), and TRUNCATED when
    turns were cut. One weight version per kept engine call. `token_versions` when every kept turn recorded
    its own (else None): each output id's, and on the environment ids before a turn the version of the
    turn's first engine call, which read them. `response` is `decode` of the last kept turn's output ids
    (the final answer, for rewards)."""
    turns = trajectory.turns
    if not turns:
        return _aborted("the trajectory has no engine call (the agent never asked for a completion)")
    kept = turns
    if max_tokens is not None:
        kept = [t for t in turns if t.out_end <= max_tokens]
        if not kept:
            return _aborted(f"the first turn ends at {turns[0].out_end} tokens > max_tokens = {max_tokens}")
    prompt_len = kept[0].out_start
    end = kept[-1].out_end
    mask, logprobs = [0] * (end - prompt_len), [0.0] * (end - prompt_len)
    for t in kept:
        n = len(t.logprobs)
        mask[t.out_start - prompt_len:t.out_end - prompt_len] = [1] * n
        logprobs[t.out_start - prompt_len:t.out_end - prompt_len] = t.logprobs
    reasons = [t.finish_reason for t in kept]
    status = Status.ABORTED if "abort" in reasons else FINISH_STATUS[reasons[-1]]
    metadata: dict[str, Any] = {"turns": [t.to_dict() for t in kept]}
    if len(kept) < len(turns) and status is not Status.ABORTED:
        status = Status.TRUNCATED
        metadata[ERROR_KEY] = f"cut after {len(kept)} of {len(turns)} turns at max_tokens = {max_tokens}"
    elif trajectory.truncated and status is not Status.ABORTED:
        status = Status.TRUNCATED
        metadata[ERROR_KEY] = trajectory.truncated
    sample = Sample(tokens=trajectory.ids[:end], response_length=end - prompt_len, loss_mask=mask,
                    rollout_logprobs=logprobs, status=status, token_versions=_token_versions(kept),
                    weight_versions=[v for t in kept for v in (t.weight_version, *t.later_versions)],
                    metadata=metadata)
    if decode is not None:
        sample.response = decode(trajectory.ids[kept[-1].out_start:end])
    return sample.validate()


def _token_versions(kept: list[Turn]) -> list[int] | None:
    """Aligned with the response; None when a kept turn has none (not recorded, or unknown)."""
    if any(t.token_versions is None for t in kept):
        return None
    versions: list[int] = []
    for i, t in enumerate(kept):
        if i:  # the environment ids before the turn: its first call read them (the first turn's are the prompt)
            versions += [int(t.weight_version)] * (t.out_start - t.env_start)
        versions += t.token_versions or []
    return versions


def _aborted(reason: str) -> Sample:
    return Sample(status=Status.ABORTED, metadata={ERROR_KEY: reason, "turns": []})
