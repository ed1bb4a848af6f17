"""verifiers environments as verst's rollout fn: the environment brings its tasks, groups and rewards;
each of its rollouts talks to its own session on the session server, which records the exact token ids.

    # my_env.py                                  # the recipe
    import verifiers as vf                       # [rollout]
    from verst.connectors.verifiers import VerifiersRollout      # rollout_fn = "my_env:rollout"
    rollout = VerifiersRollout(lambda: vf.load_environment("my-env"))
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import verifiers as vf

from verst.rollout.agentic import record_trajectory, request_kwargs, session_server, tito_metrics
from verst.rollout.generate import mark_aborted
from verst.rollout.plugins import RolloutBatch, RolloutContext
from verst.rollout.rollout_fn import RolloutError, step_metrics
from verst.types import Group, Sample, Status

METRICS_KEY = "verifiers_metrics"  # sample.metadata: the rubric's per-function scores of the rollout
STOP_KEY = "verifiers_stop"  # sample.metadata: the environment's stop condition
# A rollout's session shares the rollout manager's process with every other rollout of the step: on a busy
# machine the client's default 5 s connect timeout would cut off whole groups.
TIMEOUT = openai.Timeout(600.0, connect=60.0)


class VerifiersRollout:
    """A rollout fn (`rollout.rollout_fn`) over a verifiers `Environment`, which `load_env()` builds on the
    first call, in the process that runs the rollouts (the rollout manager's actor).

    Each step draws `n_groups` rows of the environment's dataset (`env.get_dataset()`, in a seeded order
    that is reshuffled every epoch) and runs `rollout.n_samples_per_prompt` rollouts of each through
    `env.rollout`, every one with an OpenAI client on its own session; `env.rubric.score_group` scores
    the group. A sample's tokens, loss mask and logprobs are its session's trajectory (never the
    environment's re-tokenization); its reward is the rubric's. A group with a failed rollout (an
    environment error or exception, a session refusal) or one `rollout.dynamic_filter` drops is
    replaced by the next row, for at most `rollout.max_over_sampling_rounds` rounds. Sampling follows
    `[rollout.sampling]` and `rollout.max_response_tokens`; the environment's `sampling_args` are unused.

    The position in the environment's dataset is the instance's: a resumed run starts the seeded order
    over.
    """

    def __init__(self, load_env: Callable[[], vf.Environment], *, seed: int = 0, model: str = "verst"):
        if not callable(load_env) or isinstance(load_env, vf.Environment):
            raise TypeError(f"VerifiersRollout: load_env must be a function that returns the Environment (such as "
                            f"`lambda: vf.load_environment(name)`), got {type(load_env).__name__}")
        self.load_env, self.seed, self.model = load_env, seed, model
        self._env: vf.Environment | None = None
        self._rows: list[dict[str, Any]] | None = None
        self._order: list[int] = []
        self._epoch = 0
        self._sample_index = itertools.count()
        self._group_index = itertools.count()

    async def __call__(self, ctx: RolloutContext, n_groups: int) -> RolloutBatch:
        start = time.perf_counter()
        kept: list[Group] = []
        filtered: list[Group] = []
        launched: list[Group] = []
        failed = rounds = 0
        while len(kept) < n_groups:
            if rounds >= ctx.max_rounds:
                raise RolloutError(f"VerifiersRollout: {len(kept)} of {n_groups} groups kept after {rounds} rounds "
                                   f"({len(filtered)} filtered, {failed} failed); see rollout.dynamic_filter and "
                                   "the environment's errors")
            rounds += 1
            rows = [self._next_row() for _ in range(n_groups - len(kept))]
            groups = await asyncio.gather(*(self._group(ctx, row) for row in rows))
            launched += groups
            for group in groups:
                if any(s.status is Status.ABORTED for s in group):
                    failed += 1
                elif ctx.group_filter is None or ctx.group_filter(group):
                    kept.append(group)
                else:
                    filtered.append(group)
        metrics = step_metrics(kept, filtered, launched, key=ctx.reward.key, elapsed_s=time.perf_counter() - start,
                               zero_std=ctx.rollout.dynamic_filter == "zero_std")
        metrics.update(tito_metrics([s for g in launched for s in g]))
        metrics.update({"rollout/failed_groups": float(failed), "rollout/over_sampling_rounds": float(rounds)})
        return RolloutBatch(kept, metrics)

    @property
    def env(self) -> vf.Environment:
        if self._env is None:
            with _signal_handlers_on_main_thread_only():
                env = self.load_env()
            if not isinstance(env, vf.Environment):
                raise TypeError(f"VerifiersRollout: load_env returned {type(env).__name__}; expected a verifiers "
                                "Environment")
            self._env = env
        return self._env

    def _next_row(self) -> dict[str, Any]:
        """The next dataset row in this epoch's seeded order."""
        if self._rows is None:
            self._rows = [dict(row) for row in self.env.get_dataset()]
            if not self._rows:
                raise RolloutError("VerifiersRollout: the environment's dataset is empty")
        if not self._order:
            self._order = list(range(len(self._rows)))
            random.Random(self.seed + self._epoch).shuffle(self._order)
            self._epoch += 1
        return self._rows[self._order.pop()]

    async def _group(self, ctx: RolloutContext, row: dict[str, Any]) -> Group:
        """One group: `n_samples_per_prompt` rollouts of `row`, each on its own session, scored together."""
        group_index = next(self._group_index)
        group = [Sample(prompt=row.get("prompt"), label=row.get("answer"), index=next(self._sample_index),
                        group_index=group_index, metadata={"example_id": row.get("example_id")})
                 for _ in range(ctx.rollout.n_samples_per_prompt)]
        server = await session_server(ctx)
        sessions = [server.manager.create({"sample_index": s.index, "group_index": group_index}) for s in group]
        try:
            states = await asyncio.gather(*(self._rollout(ctx, f"{server.url}/sessions/{sid}/v1", row, sample)
                                            for sid, sample in zip(sessions, group)), return_exceptions=True)
            for state in states:
                if isinstance(state, BaseException) and not isinstance(state, Exception):
                    raise state  # cancellation is the step's, not the environment's
            if not any(isinstance(state, Exception) for state in states):
                await self.env.rubric.score_group(states)
                for state in states:
                    await self.env.rubric.cleanup(state)
            for sid, sample, state in zip(sessions, group, states):
                record_trajectory(ctx, sample, server.manager.samples(sid)[0])
                if isinstance(state, Exception):  # the group fails; the samples keep what their sessions recorded
                    mark_aborted(sample, f"verifiers environment raised {state!r}")
                else:
                    _record_outcome(sample, state)
        finally:
            for sid in sessions:
                server.manager.delete(sid)
        return [s.validate() for s in group]

    async def _rollout(self, ctx: RolloutContext, base_url: str, row: dict[str, Any], sample: Sample) -> vf.State:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
            # the environment may keep the input it is given: each rollout gets its own copy
            return await self.env.rollout(dict(row), vf.OpenAIChatCompletionsClient(client), self.model,
                                          request_kwargs(ctx, sample))


@contextlib.contextmanager
def _signal_handlers_on_main_thread_only() -> Iterator[None]:
    """A verifiers Environment installs SIGINT/SIGTERM handlers when it is built, which Python allows only on
    the main thread; the rollout manager's actor builds it on another, in a process whose lifecycle is
    Ray's and verst's. There the handlers are not installed (the environment's atexit teardown still is)."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    install = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)
    try:
        yield
    finally:
        signal.signal = install


def _record_outcome(sample: Sample, state: vf.State) -> None:
    """The rubric's reward and scores, the stop condition; an environment error aborts the sample."""
    sample.metadata[STOP_KEY] = state.get("stop_condition")
    sample.metadata[METRICS_KEY] = dict(state.get("metrics") or {})
    if state.get("error") is not None:
        mark_aborted(sample, f"verifiers environment error: {state['error']!r}")
    elif sample.status is not Status.ABORTED:
        if state.get("reward") is None:
            mark_aborted(sample, "the verifiers rubric gave no reward")
        else:
            sample.reward = float(state["reward"])
