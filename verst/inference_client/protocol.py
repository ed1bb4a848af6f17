"""SGLang's native HTTP dialect as pydantic models (field names, defaults and ranges of each request body),
and `InvalidRequest`, the 400 that names the refused field and value.

Unknown fields are rejected; SGLang fields the embedded engine does not implement are accepted only at
their default value (sglang-router re-serialises requests with those defaults filled in).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue

from verst.types.sampling import SamplingKnobs

# SGLang fields the embedded engine accepts only at these values. sglang-router adds several of them to
# every forwarded /generate body, so they cannot simply be unknown fields; any other value is refused
# by name rather than silently ignored.
GENERATE_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "return_hidden_states": (False, None),
    "background": (False, None),
    "return_bytes": (False, None),
    "return_entropy": (False, None),
    "token_ids_logprob": (None,),
    "session_params": (None,),
    "lora_id": (None,),
    "custom_logit_processor": (None,),
    "input_embeds": (None,),
    "image_data": (None,),
    "video_data": (None,),
    "audio_data": (None,),
    "extra_key": (None,),
    "data_parallel_rank": (None, 0),
    "routed_dp_rank": (None, 0),
    "routed_experts_start_len": (0,),
    "return_prompt_token_ids": (False, None),
}
MAX_SAMPLES_PER_REQUEST = 1024  # sampling_params.n at most
# Accepted and deliberately without effect: bookkeeping hints that change no output.
GENERATE_IGNORED = ("model", "log_metrics", "no_logs", "routing_key", "conversation_id", "session_id")

_SAMPLING_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None,),
    "spaces_between_special_tokens": (True, None),
    "custom_params": (None,),
    "stream_interval": (None,),
}


class InvalidRequest(ValueError):
    """A request the engine refuses before scheduling it; the HTTP layer answers 400 with field and value."""

    def __init__(self, field: str, value: Any, message: str):
        super().__init__(f"{field} = {_short(value)}: {message}")
        self.field = field
        self.value = value


def without_hints(data: Any, allowed: dict[str, tuple[Any, ...]]) -> Any:
    """A raw /generate body without the fields accepted only at their defaults (`allowed`, checked as
    `check_default_only` does) and those accepted and ignored (`GENERATE_IGNORED`)."""
    data = check_default_only(data, allowed, "")
    if isinstance(data, dict):
        for name in GENERATE_IGNORED:
            data.pop(name, None)
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_default_only(data: Any, allowed: dict[str, tuple[Any, ...]], where: str) -> Any:
    """Pop `allowed` fields from a raw body, refusing any value other than the listed ones."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for name, values in allowed.items():
        if name in data:
            value = _integral(data.pop(name))
            if not any(value == v and type(value) is type(v) or value is v for v in values):
                raise ValueError(
                    f"{where}{name} = {value!r} is not supported by the embedded engine "
                    f"(accepted: {', '.join(repr(v) for v in values)})"
                )
    return data


def _integral(value: Any) -> Any:
    """JSON Schema counts 3.0 as an integer: an integral float (also inside lists) is read as that int, which
    a float field takes too; everything else stays as sent."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral(v) for v in value] if isinstance(value, list) else value


class WireModel(BaseModel):
    """Base of every request body: unknown fields are an error, never dropped; values are taken strictly
    (no 1 for true, "2" for 2 or false for 0.0), as the published JSON schema types them, and an integral
    float is an integer, as in JSON Schema.

    The published JSON schema lists the fields accepted only at their default (`accepted_only_at`, as
    an enum of those values) and those accepted and ignored, so the schema is the whole contract."""

    model_config = ConfigDict(extra="forbid", strict=True)
    accepted_only_at: ClassVar[dict[str, tuple[Any, ...]]] = {}
    accepted_and_ignored: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data: Any) -> Any:
        return {key: _integral(value) for key, value in data.items()} if isinstance(data, dict) else data

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> JsonSchemaValue:
        schema = handler(core_schema)
        target = handler.resolve_ref_schema(schema)
        properties = target.setdefault("properties", {})
        for name, values in cls.accepted_only_at.items():
            unique = [v for i, v in enumerate(values) if all(v != w or type(v) is bool for w in values[:i])]
            properties.setdefault(name, {"enum": unique, "description": "Accepted only at these values."})
        for name in cls.accepted_and_ignored:
            properties.setdefault(name, {"description": "Accepted and without effect."})
        return schema


class TokenIds:
    """Schema marker of a token-id list: the served app fills in the vocabulary (and, for a prompt, the
    context length) as bounds, so generated requests fit the model (`verst.engine.schema`)."""

    def __init__(self, kind: Literal["prompt", "tokens"]):
        self.kind = kind

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> JsonSchemaValue:
        schema = handler(core_schema)
        schema["x-token-ids"] = self.kind
        return schema


# Token ids are integers: JSON booleans and fractions are refused by name, never read as 0, 1 or rounded.
TokenId = Annotated[StrictInt, BeforeValidator(_integral)]
PromptIds = Annotated[list[TokenId], TokenIds("prompt")]


def _as_list(value: Any) -> Any:
    """SGLang and OpenAI take one stop string, a list, or null; the engine reads a list."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


class SamplingOptions(WireModel, SamplingKnobs):
    """The sampling fields SGLang's `sampling_params` and the OpenAI routes share, under the same names."""

    model_config = ConfigDict(json_schema_extra=lambda schema: schema["properties"]["top_k"].update(
        {"not": {"const": 0}}))

    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: Annotated[list[str], BeforeValidator(_as_list), WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}},
        {"type": "null"}]})] = Field(default_factory=list, description="One stop string, a list, or null.")
    stop_token_ids: Annotated[list[TokenId], TokenIds("tokens")] | None = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _stop_not_empty(cls, data: Any) -> Any:
        stop = data.get("stop") if isinstance(data, dict) else None
        if stop == "" or isinstance(stop, list) and any(s == "" for s in stop):
            raise ValueError(f"{cls.error_prefix}stop = {stop!r} contains an empty string")
        return data

    @model_validator(mode="after")
    def _no_null_stop_ids(self) -> SamplingOptions:
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        return self


class SamplingParams(SamplingOptions):
    """SGLang `sampling_params` of one /generate request; the engine samples each request by it."""

    error_prefix: ClassVar[str] = "sampling_params."
    accepted_only_at: ClassVar[dict[str, tuple[Any, ...]]] = _SAMPLING_DEFAULT_ONLY

    max_new_tokens: int | None = Field(128, ge=0, description="None: up to the context length.")
    min_new_tokens: int = Field(0, ge=0)
    no_stop_trim: bool = False
    sampling_seed: int | None = Field(None, ge=0, description="Per-request seed; same seed, same tokens.")
    n: int | None = Field(1, ge=1, le=MAX_SAMPLES_PER_REQUEST, description=(
        "Samples of the one prompt (SGLang's parallel sampling): the reply is a list of n replies, sample i under "
        "rid `{rid}_{i}` and, with sampling_seed s, seeded s + i; aborting rid aborts all of them. null: 1."))

    @model_validator(mode="before")
    @classmethod
    def _default_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and "n" in data and data["n"] is None:  # sglang-router sends null for 1
            data = {**data, "n": 1}
        return check_default_only(data, _SAMPLING_DEFAULT_ONLY, "sampling_params.")

    @model_validator(mode="after")
    def _ranges(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens = {self.min_new_tokens} exceeds max_new_tokens = {self.max_new_tokens}"
            )
        return self


class _GenerateOptions(WireModel):
    """The fields of `POST /generate` that apply to every prompt of a request."""

    accepted_only_at: ClassVar[dict[str, tuple[Any, ...]]] = GENERATE_DEFAULT_ONLY
    accepted_and_ignored: ClassVar[tuple[str, ...]] = GENERATE_IGNORED
    return_logprob: bool = False
    logprob_start_len: int | None = Field(
        None, ge=-1, description="With return_logprob: the first prompt position whose logprob comes back in "
        "meta_info.input_token_logprobs (-1 or None: output logprobs only); with max_new_tokens = 0, a prefill "
        "that scores the given tokens.")
    top_logprobs_num: int | None = Field(None, ge=0, le=64)
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False
    # SGLang's priority scheduling (higher values first): waiting requests are admitted by priority, then
    # in arrival order; running requests are not preempted.
    priority: int | None = Field(None, ge=-(2**31), le=2**31 - 1)

    @model_validator(mode="before")
    @classmethod
    def _default_only(cls, data: Any) -> Any:
        return without_hints(data, GENERATE_DEFAULT_ONLY)


class GenerateRequest(_GenerateOptions):
    """SGLang `POST /generate` with one prompt (text or token ids)."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["text"], "properties": {"text": {"type": "string"}, "input_ids": {"type": "null"}}},
        {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}, "text": {"type": "null"}}},
    ]})

    text: str | None = None
    input_ids: PromptIds | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = Field(None, min_length=1, max_length=256)
    lora_path: str | None = Field(None, min_length=1, description="The name of a loaded LoRA adapter; None: base.")

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            given = "both" if self.text is not None else "neither"
            raise ValueError(f"give exactly one of text or input_ids ({given} given)")
        if self.stream and self.sampling_params.n != 1:
            raise ValueError(f"stream = true is for one sample, not sampling_params.n = {self.sampling_params.n}")
        return self

    def samples(self) -> list[GenerateRequest]:
        """Each of the `sampling_params.n` samples as a request of one (`{rid}_{i}`, seed + i): SGLang's parallel
        sampling, as verst's engines serve it."""
        params = self.sampling_params
        if params.n == 1:
            return [self]
        seeds = [None] * params.n if params.sampling_seed is None else [params.sampling_seed + i for i in range(params.n)]
        return [self.model_copy(update={
            "rid": sample_rid(self.rid, i) if self.rid is not None else None,
            "sampling_params": params.model_copy(update={"n": 1, "sampling_seed": seeds[i]}),
        }) for i in range(params.n)]


class BatchGenerateRequest(_GenerateOptions):
    """SGLang `POST /generate` with a batch of prompts: lists of texts or of token-id lists, one sampling
    params object for all or one per prompt, one rid per prompt; answered with a list of replies in order."""

    model_config = ConfigDict(json_schema_extra={
        "description": "Lists given per prompt (sampling_params, rid, lora_path) have one entry per prompt.",
        "properties": {"stream": {"const": False, "description": "Streaming is for a single prompt."}},
        "anyOf": [
            {"required": ["text"], "properties": {"text": {"type": "array", "minItems": 1},
                                                  "input_ids": {"type": "null"}}},
            {"required": ["input_ids"], "properties": {"input_ids": {"type": "array", "minItems": 1},
                                                       "text": {"type": "null"}}},
        ]})

    text: list[str] | None = None
    input_ids: list[PromptIds] | None = None
    sampling_params: list[SamplingParams] | None = None
    rid: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = None
    # one adapter name for every prompt, or one per prompt (None: the base model), as SGLang takes it
    lora_path: str | list[Annotated[str, Field(min_length=1)] | None] | None = Field(None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _shared_sampling(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("sampling_params"), dict):
            inputs = data.get("text") if data.get("text") is not None else data.get("input_ids")
            data = {**data, "sampling_params": [data["sampling_params"]] * len(inputs or [])}
        return data

    @model_validator(mode="after")
    def _one_list(self) -> BatchGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            given = "both" if self.text is not None else "neither"
            raise ValueError(f"give exactly one of text or input_ids ({given} given)")
        n = len(self.text if self.text is not None else self.input_ids)
        if n == 0:
            raise ValueError("a batch needs at least one prompt (text or input_ids is an empty list)")
        for name in ("sampling_params", "rid", "lora_path"):
            value = getattr(self, name)
            if isinstance(value, str):
                continue
            if value is not None and len(value) != n:
                raise ValueError(f"{name} is a list of {len(value)} for a batch of {n} prompts; give one per prompt")
        if self.stream:
            raise ValueError(f"stream = true is for a single prompt, not a batch of {n}")
        for params in self.sampling_params or []:
            if params.n != 1:
                raise ValueError(f"sampling_params.n = {params.n} is for a single prompt, not a batch of {n}")
        return self

    def prompts(self) -> list[GenerateRequest]:
        """Each prompt as a single-prompt request with the shared options."""
        options = self.model_dump(include=set(_GenerateOptions.model_fields))
        inputs = self.text if self.text is not None else self.input_ids
        key = "text" if self.text is not None else "input_ids"
        loras = self.lora_path if isinstance(self.lora_path, list) else [self.lora_path] * len(inputs)
        return [GenerateRequest.model_validate({
            **options, key: inputs[i], "rid": self.rid[i] if self.rid else None, "lora_path": loras[i],
            **({"sampling_params": self.sampling_params[i]} if self.sampling_params else {}),
        }) for i in range(len(inputs))]


def sample_rid(rid: str, i: int) -> str:
    """The rid of sample i of a request with `sampling_params.n` > 1 (SGLang's form)."""
    return f"{rid}_{i}"


def is_sample_of(key: str, rid: str) -> bool:
    """Whether `key` is the rid of a sample of request `rid` (`sample_rid(rid, i)`): aborting `rid` ends it."""
    return key.startswith(f"{rid}_")


def is_batch(body: Any) -> bool:
    """Whether a raw /generate body is SGLang's batch form (a list of texts or of token-id lists)."""
    if not isinstance(body, dict):
        return False
    ids = body.get("input_ids")
    return isinstance(body.get("text"), list) or isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)


# The finish message of a request a weight update aborted (`pause_generation(mode='abort')`, or a weight
# load or version update with `abort_all_requests`), as verst's engines send it. SGLang ends every request an
# abort-all ends (and one aborted by rid) with its generic message: a caller that aborted nothing by rid
# itself reads that as a weight update too.
WEIGHT_UPDATE_ABORT = "aborted for a weight update"
SGLANG_ABORT = "Aborted by AbortReq."
WEIGHT_UPDATE_ABORTS = (WEIGHT_UPDATE_ABORT, SGLANG_ABORT)


class AbortRequest(WireModel):
    rid: str = ""
    abort_all: bool = False


class PauseRequest(WireModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class FlushCacheRequest(WireModel):
    pass
