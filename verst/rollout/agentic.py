"""The agentic generate fn: one sample is one session on the session server. The configured agent fn runs
the episode against the session's OpenAI URL; the session's trajectory, with the exact ids the engines
sampled, becomes the sample.

Set `rollout.generate_fn = "verst.rollout.agentic:generate"` and `rollout.agent_fn` to the agent. The
agent fn is called as `run(base_url, prompt, request_kwargs, metadata)`: `base_url` is
`{server}/sessions/{id}/v1` (for `openai.AsyncOpenAI(base_url=...)`), `prompt` the data prompt (text
or messages), `request_kwargs` keyword arguments for `chat.completions.create` (temperature, top_p,
max_tokens, logprobs=True, seed and stop when configured; sampling params OpenAI lacks, such as top_k,
apply as the session server's defaults) and `metadata` a copy of the sample's metadata (tools included
when the task has them). The dict it returns is merged into the sample's metadata. With `sandbox.provider`
set it is also given `sandbox=`: the episode's workspace, holding the files in `metadata[sandbox.files_key]`,
from the run's `SandboxPool` (`sandbox.lifetime`), released when the agent fn returns or raises.

With `rollout.partial_rollout` the session server continues a turn that a weight update aborted, and the sample
records each token's version (`Sample.token_versions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from verst.rollout.generate import CACHED_TOKENS_KEY, CONTINUED_KEY, ENGINE_PROMPT_TOKENS_KEY, mark_aborted
from verst.rollout.worker import GENERATE_ERROR_KEY
from verst.sandbox import Sandbox, SandboxPool
from verst.sandbox import provider as sandbox_provider
from verst.session.assemble import ERROR_KEY
from verst.session.manager import MISMATCH_KEY, SessionManager
from verst.session.tito import mismatch_rates
from verst.types import Sample, Status

if TYPE_CHECKING:
    from verst.rollout.plugins import RolloutContext
    from verst.session.http import SessionServer

logger = logging.getLogger(__name__)

SERVER_KEY = "session_server"  # ctx.resources: the context's SessionServer
SANDBOXES_KEY = "sandboxes"  # ctx.resources: the context's SandboxPool (with sandbox.provider)
# per-sample fields an assembled trajectory brings; the rest of the sample (index, prompt, label, ...) stays
_TRAJECTORY_KEYS = ("turns", MISMATCH_KEY, "messages", "rollbacks")


async def generate(ctx: RolloutContext, sample: Sample) -> Sample:
    """Create a session, run `ctx.agent_fn` against it, assemble its trajectory into `sample`, delete it.

    An exception from the agent marks the sample ABORTED with the reason (whatever the session recorded
    is kept for inspection); a return value other than a dict or None is a broken agent and raises.
    """
    if ctx.agent_fn is None:
        raise ValueError("agentic generate fn: rollout.agent_fn is not set; name an agent fn "
                         "`async def run(base_url, prompt, request_kwargs, metadata) -> dict | None`")
    if sample.response_length:
        raise ValueError(f"agentic generate fn: sample {sample.index} already has response_length = "
                         f"{sample.response_length}; an episode starts from the prompt")
    if sample.index in ctx.state.stopped:
        return mark_aborted(sample, "the rollout step ended before generation started")
    server = await session_server(ctx)
    manager: SessionManager = server.manager
    session_id = manager.create({"sample_index": sample.index, "group_index": sample.group_index},
                                on_request=_track_requests(ctx, sample),
                                stopped=lambda: sample.index in ctx.state.stopped)
    error, extra = None, None
    try:
        try:
            async with episode_sandbox(ctx, sample) as sandbox:
                extra = await ctx.agent_fn(f"{server.url}/sessions/{session_id}/v1", sample.prompt,
                                           request_kwargs(ctx, sample), dict(sample.metadata),
                                           **({} if sandbox is None else {"sandbox": sandbox}))
        except Exception as exc:  # the agent failing is this episode's outcome, not the rollout's
            logger.warning("agent fn failed for sample %d (group %d): %r", sample.index, sample.group_index, exc)
            error = f"agent fn raised {exc!r}"
        assembled = manager.samples(session_id)[0]
    finally:
        manager.delete(session_id)
    record_trajectory(ctx, sample, assembled)
    if extra is not None:
        if not isinstance(extra, dict):
            raise TypeError(f"agent fn {ctx.agent_fn!r} returned {type(extra).__name__}; expected dict or None")
        sample.metadata.update(extra)
    if error is not None:
        mark_aborted(sample, error)
    return sample.validate()


def request_kwargs(ctx: RolloutContext, sample: Sample) -> dict[str, Any]:
    """OpenAI `chat.completions.create` keyword arguments from the rollout config, per sample. Without
    `logprobs`: the trainer takes them from the session, and a reply carrying them grows by ~70 bytes a token."""
    params = ctx.sampling_params or {}
    kwargs: dict[str, Any] = {"temperature": params.get("temperature", 1.0), "top_p": params.get("top_p", 1.0),
                              "max_tokens": ctx.rollout.max_response_tokens}
    if params.get("stop"):
        kwargs["stop"] = list(params["stop"])
    if ctx.rollout.sampling.seed is not None:
        kwargs["seed"] = ctx.rollout.sampling.seed + sample.index
    return kwargs


def record_trajectory(ctx: RolloutContext, sample: Sample, assembled: Sample) -> None:
    """Copy an assembled trajectory's tokens, masks, logprobs, status and versions onto `sample`; the engine
    calls that went on after a weight update are counted in `metadata[CONTINUED_KEY]`."""
    sample.tokens, sample.response_length = assembled.tokens, assembled.response_length
    sample.loss_mask, sample.rollout_logprobs = assembled.loss_mask, assembled.rollout_logprobs
    sample.status, sample.response = assembled.status, assembled.response
    sample.weight_versions.extend(assembled.weight_versions)
    sample.token_versions = assembled.token_versions
    for version in assembled.weight_versions:
        ctx.state.observe_version(version)
    meta = sample.metadata
    turns = assembled.metadata.get("turns", [])
    meta[CACHED_TOKENS_KEY] = meta.get(CACHED_TOKENS_KEY, 0) + sum(t["cached_tokens"] for t in turns)
    meta[ENGINE_PROMPT_TOKENS_KEY] = meta.get(ENGINE_PROMPT_TOKENS_KEY, 0) + sum(t["prompt_tokens"] for t in turns)
    if continued := sum(t["continued"] for t in turns):
        meta[CONTINUED_KEY] = meta.get(CONTINUED_KEY, 0) + continued
    meta.update({k: assembled.metadata[k] for k in _TRAJECTORY_KEYS if k in assembled.metadata})
    if ERROR_KEY in assembled.metadata:
        meta[ERROR_KEY] = assembled.metadata[ERROR_KEY]
    if assembled.status is Status.ABORTED:
        meta[GENERATE_ERROR_KEY] = assembled.metadata.get(ERROR_KEY) or "the session's trajectory was aborted"


async def session_server(ctx: RolloutContext) -> SessionServer:
    """The context's session server (in `ctx.resources`), started on first use in the running loop on a
    free 127.0.0.1 port; `ctx.aclose()` stops it. A server left by an earlier, finished event loop
    died with it and is replaced."""
    from verst.session.http import SessionServer

    loop = asyncio.get_running_loop()
    server = ctx.resources.get(SERVER_KEY)
    if server is None or (server.loop is not None and server.loop is not loop):
        manager = SessionManager(ctx.engine, ctx.tokenizer, max_context_tokens=ctx.rollout.max_context_tokens,
                                 max_new_tokens=ctx.rollout.max_response_tokens,
                                 default_sampling=ctx.sampling_params, partial_rollout=ctx.rollout.partial_rollout)
        server = ctx.resources[SERVER_KEY] = SessionServer(manager, host="127.0.0.1", port=0)
    await server.start()
    return server


@contextlib.asynccontextmanager
async def episode_sandbox(ctx: RolloutContext, sample: Sample) -> AsyncIterator[Sandbox | None]:
    """The episode's sandbox from the context's pool (None without `sandbox.provider`), released at the end. A
    sample without the files is a broken data set and raises; a sandbox that fails to start or to close fails
    the episode."""
    if ctx.sandbox.provider is None:
        yield None
        return
    files = sample.metadata.get(ctx.sandbox.files_key)
    if not isinstance(files, dict):
        raise ValueError(f"sandbox.files_key = {ctx.sandbox.files_key!r}: sample {sample.index}'s metadata holds "
                         f"{type(files).__name__} there, not the files (path to text) its workspace starts from "
                         f"(metadata keys {sorted(sample.metadata)})")
    pool = await sandbox_pool(ctx)
    sandbox = await pool.acquire(sample.group_index, sample.index, files)
    try:
        yield sandbox
    finally:
        await pool.release(sample.group_index, sample.index, sandbox)


async def sandbox_pool(ctx: RolloutContext) -> SandboxPool:
    """The context's sandbox pool (in `ctx.resources`), built on first use; `ctx.aclose()` closes every sandbox
    it still holds."""
    pool = ctx.resources.get(SANDBOXES_KEY)
    if pool is None:
        # the provider checks its tools once when built (bwrap's probe, a cloud credential), in a thread
        provider = await asyncio.to_thread(sandbox_provider, ctx.sandbox.provider)
        pool = ctx.resources.setdefault(SANDBOXES_KEY, SandboxPool(provider, ctx.sandbox.lifetime,
                                                                   ctx.rollout.n_samples_per_prompt))
    return pool


def session_metrics(ctx: RolloutContext) -> dict[str, float]:
    """The context's session server metrics (mismatch rates over every session it assembled), or {}."""
    server = ctx.resources.get(SERVER_KEY)
    return server.manager.metrics() if server is not None else {}


def tito_metrics(samples: list[Sample]) -> dict[str, float]:
    """`rollout/tito_mismatch_rate/*` over the samples that carry a mismatch check (agentic or multi-turn)."""
    checked = [s.metadata[MISMATCH_KEY] for s in samples if MISMATCH_KEY in s.metadata]
    return mismatch_rates([[m["kind"] for m in found] for found in checked])


def _track_requests(ctx: RolloutContext, sample: Sample):
    """Register the session's engine requests like the default generate fn's, so the end of a rollout
    step aborts them by rid."""

    def on_request(rid: str, started: bool) -> None:
        if started:
            ctx.state.in_flight[rid] = sample.index
        else:
            ctx.state.in_flight.pop(rid, None)

    return on_request
