"""The three rollout plug-in layers (rollout fn ⊃ generate fn ⊃ agent fn): their signatures, the context
they share, and the loader that resolves `rollout.rollout_fn / generate_fn / agent_fn` import paths.

Signatures (each an `async def`, or an instance with an `async def __call__`; not a class):

- generate fn: `async generate(ctx: RolloutContext, sample: Sample) -> Sample` — owns one sample's
  generation and token recording: fills `tokens` (prompt + response ids), `response_length`,
  `loss_mask`, `rollout_logprobs`, `status`, appends one `weight_versions` entry per engine call
  (the oldest version behind its tokens; the default generate fn also appends the newest when a sync
  fell inside the call), may set `token_versions` (each response token's version; None: unknown) and sets
  `response` (text for rewards). It returns the sample (the same object or a new one); it does
  not score it. An exception it raises marks the sample ABORTED with the reason (recovered and counted).
- rollout fn: `async rollout(ctx: RolloutContext, n_groups: int) -> RolloutBatch` — owns data,
  batching and rewards: draws prompts from `ctx.source`, calls `ctx.generate_fn`, scores, filters and
  returns exactly `n_groups` finished groups of `rollout.n_samples_per_prompt` scored samples each.
- agent fn: `async run(base_url, prompt, request_kwargs, metadata) -> dict | None` — owns only the
  episode loop; talks to the session server's OpenAI-compatible base URL `{server}/sessions/{id}/v1`
  (requests go to `{base_url}/chat/completions`); the dict it returns is merged into the sample's metadata.
  With `sandbox.provider` set it is also given `sandbox=`, the episode's workspace (`verst.sandbox.Sandbox`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from verst.config import (
    ConfigError,
    DataConfig,
    DiffusionConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    SandboxConfig,
    load_object,
)
from verst.config.rules import DEFAULT_GENERATE_FN, DEFAULT_ROLLOUT_FN
from verst.rewards import build_reward_fn
from verst.rollout.filters import GroupFilter, build_filter
from verst.types import Group, Sample

if TYPE_CHECKING:
    from verst.config import VerstConfig
    from verst.data import DataSource
    from verst.inference_client.client import EngineClient
    from verst.rewards import GroupRewardFn, RewardFn
    from verst.rollout.teacher import TeacherScorer


# ---- the contract ----------------------------------------------------------------------------
@dataclasses.dataclass
class RolloutBatch:
    """What a rollout fn returns: finished, scored groups (ordered by first sample index) and flat
    `rollout/`, `perf/`, `time/` metrics of the step."""

    groups: list[Group]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


class GenerateFn(Protocol):
    async def __call__(self, ctx: RolloutContext, sample: Sample) -> Sample: ...


class RolloutFn(Protocol):
    async def __call__(self, ctx: RolloutContext, n_groups: int) -> RolloutBatch: ...


class AgentFn(Protocol):
    async def __call__(
        self, base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]
    ) -> dict[str, Any] | None: ...


# The built-in layers, loaded by import path as a plug-in is (they import this module for its contract).
# name -> (config field, positional arguments it is called with, the documented signature)
_LAYERS: dict[str, tuple[str, int, str]] = {
    "generate": ("rollout.generate_fn", 2, "async def generate(ctx, sample) -> Sample"),
    "rollout": ("rollout.rollout_fn", 2, "async def rollout(ctx, n_groups) -> RolloutBatch"),
    "agent": ("rollout.agent_fn", 4, "async def run(base_url, prompt, request_kwargs, metadata) -> dict | None"),
}


def check_plugin(fn: Any, layer: str, path: str | None = None) -> Any:
    """Return `fn` if it fits the layer's signature, else raise ConfigError naming the field and path."""
    field, n_args, signature = _LAYERS[layer]
    where = f"{field} = {path!r}" if path is not None else f"{field} ({fn!r:.80})"
    if inspect.isclass(fn):
        raise ConfigError(f"{where} is a class; name a function or an instance, expected `{signature}`")
    if not callable(fn):
        raise ConfigError(f"{where} is not callable ({type(fn).__name__}); expected `{signature}`")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise ConfigError(f"{where} is not an async function; expected `{signature}`")
    try:
        params = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read its signature ({e}); expected `{signature}`") from None
    try:
        params.bind(*range(n_args))
    except TypeError as e:
        raise ConfigError(f"{where} has signature {params} which cannot be called as `{signature}` ({e})") from None
    return fn


def load_plugin(path: str, layer: str) -> Any:
    """Import the object at `path` for one layer ('generate', 'rollout' or 'agent') and check it."""
    field = _LAYERS[layer][0]
    return check_plugin(load_object(path, field), layer, path)


def load_generate_fn(cfg: RolloutConfig) -> GenerateFn:
    """`rollout.generate_fn`, or the default single-turn generate fn (`DEFAULT_GENERATE_FN`)."""
    return load_plugin(cfg.generate_fn or DEFAULT_GENERATE_FN, "generate")


def load_rollout_fn(cfg: RolloutConfig) -> RolloutFn:
    """`rollout.rollout_fn`, or the default over-sampling rollout fn (`DEFAULT_ROLLOUT_FN`)."""
    return load_plugin(cfg.rollout_fn or DEFAULT_ROLLOUT_FN, "rollout")


def check_takes_a_sandbox(agent_fn: AgentFn | None, provider: str) -> None:
    """With `sandbox.provider` set, the agent fn is called with `sandbox=` (its episode's sandbox) as well."""
    where = f"sandbox.provider = {provider!r}"
    if agent_fn is None:
        raise ConfigError(f"{where} hands each episode a sandbox through rollout.agent_fn, which is not set")
    try:
        inspect.signature(agent_fn).bind(*range(_LAYERS["agent"][1]), sandbox=None)
    except TypeError:
        raise ConfigError(f"{where}: the agent fn is called as `run(base_url, prompt, request_kwargs, metadata, "
                          f"sandbox=...)`; rollout.agent_fn ({agent_fn!r:.80}) has signature "
                          f"{inspect.signature(agent_fn)}: add a `sandbox` parameter") from None


def load_agent_fn(cfg: RolloutConfig) -> AgentFn | None:
    """`rollout.agent_fn`, or None (no agent: the generate fn talks to the engines itself)."""
    return None if cfg.agent_fn is None else load_plugin(cfg.agent_fn, "agent")


# ---- the shared context ----------------------------------------------------------------------
def default_sampling_params(cfg: SamplingConfig) -> dict[str, Any]:
    """SGLang `sampling_params` from the config, without the per-request parts (max_new_tokens, seed)."""
    params: dict[str, Any] = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
    if cfg.stop:
        params["stop"] = list(cfg.stop)
    if cfg.stop_token_ids:
        params["stop_token_ids"] = list(cfg.stop_token_ids)
    return params


class RolloutState:
    """Mutable bookkeeping shared by every copy of a context (`dataclasses.replace` keeps the object)."""

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}  # rid -> sample index, for requests the engines may hold
        self.stopped: set[int] = set()  # sample indices whose generation must not start or continue
        self.latest_weight_version: int | None = None  # highest version any engine reply reported
        self.step = 0  # rollout steps finished (numbers dump files)
        self.closing = False  # set by `RolloutContext.aclose`: failures after it are the shutdown, not errors
        self._rid_prefix = uuid.uuid4().hex[:8]  # unique across processes sharing an engine
        self._rid_counter = itertools.count()
        self._limiter: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        # (prompt, tools) -> its ids: the samples of a group share one prompt, rendered and tokenized once
        self.prompt_ids: collections.OrderedDict[tuple[str, str], list[int]] = collections.OrderedDict()

    def new_rid(self, sample: Sample) -> str:
        return f"verst-{self._rid_prefix}-{sample.index}-{next(self._rid_counter)}"

    def observe_version(self, version: str) -> None:
        try:
            number = int(version)
        except ValueError:
            raise ValueError(f"engine reported weight_version {version!r}; verst versions are integer strings "
                             "(start engines with --weight-version 0)") from None
        if self.latest_weight_version is None or number > self.latest_weight_version:
            self.latest_weight_version = number

    def limiter(self, concurrency: int) -> asyncio.Semaphore:
        """The semaphore bounding concurrent generate calls, one per event loop (tests run several)."""
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._limiter[0] is not loop:
            self._limiter = (loop, asyncio.Semaphore(concurrency))
        return self._limiter[1]


def routed_experts_top_k(cfg: VerstConfig) -> int | None:
    """The policy's experts per token when `algorithm.routing_replay` records routed experts, else None."""
    if cfg.algorithm.routing_replay == "off":
        return None
    config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    if not config.get("num_experts_per_tok"):
        raise ValueError(f"algorithm.routing_replay = {cfg.algorithm.routing_replay!r} needs an MoE model; "
                         f"model.path = {cfg.model.path!r} has no num_experts_per_tok")
    return int(config["num_experts_per_tok"])


@dataclasses.dataclass
class RolloutContext:
    """Everything a rollout fn, generate fn or reward hook needs; built once per run.

    `generate_fn`, `rollout_fn`, `agent_fn`, `reward_fn` and `group_filter` left at None are resolved
    from the config (`rollout.*_fn`, `reward`, `rollout.dynamic_filter`); `sampling_params` from
    `rollout.sampling`. `control_engines` receive aborts: the router has no abort route, so behind a
    router list every engine here (default: `[engine]`). `dump_dir`: rollout-only mode, every batch
    `run_rollout` returns is also written there (see `rollout_fn.dump_batch`). `teacher` (on-policy
    distillation) scores every finished group; None without a teacher.
    """

    engine: EngineClient | Any  # generate target: one engine or the router in front of several
    tokenizer: Any
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)  # the agent's sandboxes, if any
    source: DataSource | None = None
    generate_fn: GenerateFn | None = None
    rollout_fn: RolloutFn | None = None
    agent_fn: AgentFn | None = None
    reward_fn: RewardFn | GroupRewardFn | None = None
    group_filter: GroupFilter | None = None
    sampling_params: dict[str, Any] | None = None
    control_engines: list[Any] = dataclasses.field(default_factory=list)
    dump_dir: Path | None = None
    teacher: TeacherScorer | None = None
    max_rounds: int = 32  # over-sampling rounds per step before a step that cannot fill its batch fails
    abort_timeout_s: float = 10.0  # end of step: wait this long for aborted requests, then cancel them
    state: RolloutState = dataclasses.field(default_factory=RolloutState)
    # MoE routing replay: the policy's experts per token (num_experts_per_tok) when the samples record the
    # engines' routed experts (`algorithm.routing_replay`); None: they do not
    routed_experts_top_k: int | None = None
    diffusion: DiffusionConfig | None = None  # model.kind = "diffusion": the image sampler's settings
    # what plug-ins build lazily and share across calls (the agentic generate fn's session server), by
    # name; `aclose` closes every value with an `aclose()`. Copies of the context share the dict.
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.generate_fn is None:
            self.generate_fn = load_generate_fn(self.rollout)
        else:
            check_plugin(self.generate_fn, "generate")
        if self.rollout_fn is None:
            self.rollout_fn = load_rollout_fn(self.rollout)
        else:
            check_plugin(self.rollout_fn, "rollout")
        if self.agent_fn is None:
            self.agent_fn = load_agent_fn(self.rollout)  # used by an agentic generate fn; None when unset
        else:
            check_plugin(self.agent_fn, "agent")
        if self.sandbox.provider is not None:
            check_takes_a_sandbox(self.agent_fn, self.sandbox.provider)
        if self.reward_fn is None:
            self.reward_fn = build_reward_fn(self.reward)
        if self.group_filter is None:
            self.group_filter = build_filter(self.rollout.dynamic_filter, self.reward.key)
        if self.sampling_params is None:
            self.sampling_params = default_sampling_params(self.rollout.sampling)
        if not self.control_engines:
            self.control_engines = [self.engine]
        if self.max_rounds < 1:
            raise ValueError(f"RolloutContext.max_rounds must be >= 1, got {self.max_rounds}")
        if self.dump_dir is not None:
            self.dump_dir = Path(self.dump_dir)

    @classmethod
    def from_config(
        cls, cfg: VerstConfig, engine: Any, tokenizer: Any, source: DataSource | None, **overrides: Any
    ) -> RolloutContext:
        settings = dict(max_rounds=cfg.rollout.max_over_sampling_rounds, abort_timeout_s=cfg.rollout.abort_timeout_s,
                        dump_dir=cfg.rollout.dump_dir, routed_experts_top_k=routed_experts_top_k(cfg),
                        diffusion=cfg.diffusion if cfg.model.kind == "diffusion" else None)
        return cls(engine=engine, tokenizer=tokenizer, rollout=cfg.rollout, data=cfg.data, reward=cfg.reward,
                   sandbox=cfg.sandbox, source=source, **{**settings, **overrides})

    async def aclose(self) -> None:
        """Close what the context built (a remote reward client) and what plug-ins put in `resources`."""
        self.state.closing = True
        close = getattr(self.reward_fn, "aclose", None)
        if close is not None:
            await close()
        if self.teacher is not None:
            await self.teacher.aclose()
        while self.resources:
            _, resource = self.resources.popitem()
            close = getattr(resource, "aclose", None)
            if close is not None:
                await close()
