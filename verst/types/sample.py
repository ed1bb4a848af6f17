"""The one record that flows from rollout to trainer: a `Sample` is one trajectory of one prompt.

Per-token arrays cover the response only and have documented equal lengths, checked by `validate()`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
from typing import Any


class Status(str, enum.Enum):
    """Where a trajectory stands; the values are the wire strings."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit the response or context limit
    ABORTED = "aborted"  # generation gave up (pause in abort mode, agent error, cancel)
    FAILED = "failed"  # recoverable failure; may hold partial output


class SampleError(ValueError):
    """A Sample broke one of its invariants; the message carries the offending values."""


@dataclasses.dataclass
class Sample:
    """One trajectory: prompt ids followed by response ids, plus what the trainer needs about them.

    `tokens` holds prompt + response ids; the last `response_length` of them are the response.
    `loss_mask` and `rollout_logprobs` are aligned with the response: 1 / the engine's logprob on
    tokens the policy sampled, 0 / 0.0 on environment and tool tokens inserted between turns.
    `weight_versions` gets one entry per engine call (the oldest version behind its tokens), and the
    single-turn generate fn adds the call's newest when a weight sync fell inside it; staleness is
    measured from the oldest one. `routed_experts` (MoE) is `[len(tokens) - 1][layers][top_k]`: the experts
    the engine ran for every token but the last, prompt included (`algorithm.routing_replay`).
    `token_versions` is the weight version that sampled each response token, aligned with the response like
    `rollout_logprobs` (on environment tokens, which carry loss mask 0, the version of the engine call that read
    them: the first call of the turn that follows them); None where a generate fn could not tell (an engine call
    a weight update fell inside, under `retract` or `in_place`), or did not record them (they are recorded with
    `rollout.partial_rollout`). Then one response, even one turn, spans versions: the tokens before a weight
    update carry the old one, its continuation's the new one.
    `teacher_logprobs` (on-policy distillation) are a teacher model's logprobs of the response tokens,
    aligned with the response like `rollout_logprobs` (0.0 on environment tokens); None without a teacher.

    An image trajectory (a diffusion model, docs/diffusion.md) is a sample too: a denoising step plays a token's
    part. `tokens` are the class id, then the step numbers 0..steps − 1 (`response_length` = steps);
    `rollout_logprobs` are the engine's step log-probabilities and `latents` the recorded latents
    (steps + 1, C, H, W), from the start noise to the image, as {"data": base64 of float32 C-order bytes,
    "shape", "dtype"} (`verst.types.arrays.encode_array`). None for text.
    """

    tokens: list[int] = dataclasses.field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    reward: float | dict[str, float] | None = None
    status: Status = Status.PENDING
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    routed_experts: list[list[list[int]]] | None = None
    token_versions: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    latents: dict[str, Any] | None = None
    group_index: int = 0
    index: int = 0
    label: Any = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Text at the edges: the prompt as given by the data source (str or chat messages) and the
    # decoded response, for rewards and logs. The trainer never reads these.
    prompt: str | list[dict[str, Any]] = ""
    response: str = ""

    # ---- derived views -------------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def effective_response_length(self) -> int:
        """Number of response tokens the policy sampled (loss_mask == 1)."""
        return sum(self.loss_mask)

    def oldest_weight_version(self) -> int | None:
        """The oldest numeric weight version that produced any token of this sample, if any."""
        if not self.weight_versions:
            return None
        return min(_version_number(v, self.index) for v in self.weight_versions)

    def reward_value(self, key: str | None = None) -> float:
        """The scalar reward: the float itself, or `reward[key]` for dict rewards."""
        if self.reward is None:
            raise SampleError(f"sample {self.index}: reward is not set")
        if isinstance(self.reward, dict):
            if key is None or key not in self.reward:
                raise SampleError(
                    f"sample {self.index}: reward is a dict with keys {sorted(self.reward)}; "
                    f"reward key {key!r} does not select one"
                )
            return float(self.reward[key])
        return float(self.reward)

    # ---- invariants ----------------------------------------------------------------------
    def validate(self) -> Sample:
        """Check the length and value invariants; raise SampleError naming the offending values."""
        where = f"sample {self.index} (group {self.group_index})"
        n_tok, n_resp = len(self.tokens), self.response_length
        if not isinstance(self.status, Status):
            raise SampleError(f"{where}: status {self.status!r} is not a Status")
        if n_resp < 0 or n_resp > n_tok:
            raise SampleError(f"{where}: response_length {n_resp} outside [0, len(tokens)={n_tok}]")
        if n_resp and n_resp == n_tok:
            raise SampleError(f"{where}: no prompt tokens (len(tokens)={n_tok}, response_length={n_resp})")
        if len(self.loss_mask) != n_resp:
            raise SampleError(f"{where}: len(loss_mask)={len(self.loss_mask)} != response_length={n_resp}")
        if len(self.rollout_logprobs) != n_resp:
            raise SampleError(
                f"{where}: len(rollout_logprobs)={len(self.rollout_logprobs)} != response_length={n_resp}"
            )
        mask_values = set(self.loss_mask)
        if not mask_values <= {0, 1}:
            raise SampleError(f"{where}: loss_mask values must be 0 or 1, found {sorted(mask_values - {0, 1})}")
        # the scan runs in C (compress, any): a multi-turn sample holds tens of thousands of tokens
        if 0 in mask_values and any(itertools.compress(self.rollout_logprobs, map(operator.not_, self.loss_mask))):
            env_logprobs = [lp for m, lp in zip(self.loss_mask, self.rollout_logprobs) if m == 0 and lp != 0.0]
            raise SampleError(f"{where}: rollout_logprobs must be 0.0 on loss_mask==0 tokens, found {env_logprobs[:3]}")
        if self.teacher_logprobs is not None:
            if len(self.teacher_logprobs) != n_resp:
                raise SampleError(
                    f"{where}: len(teacher_logprobs)={len(self.teacher_logprobs)} != response_length={n_resp}"
                )
            env_teacher = [lp for m, lp in zip(self.loss_mask, self.teacher_logprobs) if m == 0 and lp != 0.0]
            if env_teacher:
                raise SampleError(f"{where}: teacher_logprobs must be 0.0 on loss_mask==0 tokens, found {env_teacher[:3]}")
        if self.token_versions is not None and len(self.token_versions) != n_resp:
            raise SampleError(
                f"{where}: len(token_versions)={len(self.token_versions)} != response_length={n_resp}"
            )
        if self.routed_experts is not None and len(self.routed_experts) != max(n_tok - 1, 0):
            raise SampleError(
                f"{where}: len(routed_experts)={len(self.routed_experts)} != len(tokens) - 1 = {n_tok - 1}"
            )
        if self.latents is not None:
            shape = self.latents.get("shape") if isinstance(self.latents, dict) else None
            if not shape or shape[0] != n_resp + 1:
                raise SampleError(f"{where}: latents of shape {shape} for response_length={n_resp} "
                                  f"(one latent per denoising step and the start noise: {n_resp + 1})")
        for v in self.weight_versions:
            _version_number(v, self.index)
        return self

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (status as its string)."""
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        unknown = set(d).difference(FIELD_NAMES)
        if unknown:
            raise SampleError(f"Sample.from_dict: unknown keys {sorted(unknown)}")
        kwargs = dict(d)
        if "status" in kwargs:
            try:
                kwargs["status"] = Status(kwargs["status"])
            except ValueError:
                raise SampleError(
                    f"Sample.from_dict: status {kwargs['status']!r} is not one of {[s.value for s in Status]}"
                ) from None
        return cls(**kwargs)


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Sample))


def _version_number(version: str, index: int) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        raise SampleError(f"sample {index}: weight version {version!r} is not an integer string") from None
