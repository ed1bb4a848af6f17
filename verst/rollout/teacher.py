"""On-policy distillation's teacher side: after a group is generated, each finished sample's tokens are
scored by the teacher's engines in one prefill, and the sample carries the teacher's logprobs.

The teacher sees exactly the student's ids (same tokenizer, checked before the run starts) and scores the
response positions at the rollout temperature, the distribution the trainer computes the student's at.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from verst.types import Group, Sample, Status

# sample.metadata: seconds the teacher took to score the sample's group (its samples concurrently)
TEACHER_SECONDS_KEY = "teacher_score_s"
_FINISHED = (Status.COMPLETED, Status.TRUNCATED)


class TeacherScorer:
    """Scores samples on the teacher: `await scorer.score_group(group)` sets `teacher_logprobs` on every
    finished sample (0.0 on environment tokens, as `rollout_logprobs`). `clients` are `EngineClient`s of
    the teacher's engines, addressed directly: each request goes to the one with the fewest in flight
    (scoring has no prefix to keep together, and needs no router). `temperature` is the rollout's (0:
    greedy, scored at 1)."""

    def __init__(self, clients: list[Any], temperature: float = 1.0, concurrency: int = 256):
        if not clients:
            raise ValueError("TeacherScorer needs at least one teacher engine client")
        self.clients = list(clients)
        self.temperature = temperature or 1.0
        self.concurrency = concurrency
        self.in_flight = [0] * len(self.clients)
        self._limiter: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def score_sample(self, sample: Sample) -> None:
        if sample.response_length == 0:
            sample.teacher_logprobs = []
            return
        async with self._limit():
            index = min(range(len(self.clients)), key=self.in_flight.__getitem__)
            self.in_flight[index] += 1
            try:
                logprobs = await self.clients[index].score(sample.tokens, sample.prompt_length,
                                                           {"temperature": self.temperature})
            finally:
                self.in_flight[index] -= 1
        sample.teacher_logprobs = [lp if keep else 0.0 for lp, keep in zip(logprobs, sample.loss_mask)]

    async def score_group(self, group: Group) -> None:
        """Every finished sample of the group, concurrently; the group's wall time goes into each sample's
        metadata (`TEACHER_SECONDS_KEY`)."""
        start = time.perf_counter()
        await asyncio.gather(*(self.score_sample(s) for s in group
                               if s.status in _FINISHED and s.teacher_logprobs is None))
        elapsed = time.perf_counter() - start
        for s in group:
            s.metadata[TEACHER_SECONDS_KEY] = elapsed

    async def aclose(self) -> None:
        await asyncio.gather(*(client.close() for client in self.clients))

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._limiter is None or self._limiter[0] is not loop:
            self._limiter = (loop, asyncio.Semaphore(self.concurrency))
        return self._limiter[1]


def teacher_metrics(samples: list[Sample]) -> dict[str, float]:
    """`rollout/teacher_kl`: mean over policy tokens of log π_rollout − log π_teacher (the k1 estimate of
    the student's reverse KL to the teacher on its own samples); `rollout/teacher_score_seconds`: the mean
    wall time of one group's scoring. Empty when no sample was scored."""
    scored = [s for s in samples if s.teacher_logprobs is not None]
    if not scored:
        return {}
    diffs = [r - t for s in scored for r, t, m in zip(s.rollout_logprobs, s.teacher_logprobs, s.loss_mask) if m]
    out = {"rollout/teacher_kl": statistics.fmean(diffs) if diffs else 0.0}
    seconds = [s.metadata[TEACHER_SECONDS_KEY] for s in scored if TEACHER_SECONDS_KEY in s.metadata]
    if seconds:
        out["rollout/teacher_score_seconds"] = statistics.fmean(seconds)
    return out
