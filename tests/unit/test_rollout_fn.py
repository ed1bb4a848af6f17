"""The default rollout fn over the real data source, default generate fn and reward plumbing, with a
scripted engine at the HTTP edge: over-sampling rounds, the zero-variance filter, abort of leftovers by
rid, return to the source, failures, metrics against the samples, the async worker hooks and dumps."""

import asyncio
import statistics

import pytest

from verst.config import RewardConfig, RolloutConfig, SamplingConfig
from verst.data import PromptSource
from verst.inference_client.client import EngineError, GenerateResult
from verst.models.chat_template import TINY_CHAT_TEMPLATE
from verst.models.loader import load_tokenizer
from verst.models.tokenizer import save_tokenizer
from verst.rewards import RewardError
from verst.rollout import AsyncRolloutWorker, FifoBuffer
from verst.rollout.plugins import RolloutContext
from verst.rollout.rollout_fn import (
    RolloutError,
    abort_in_flight,
    load_dump,
    rollout,
    run_rollout,
    step_metrics,
    worker_hooks,
)
from verst.types import Sample, Status

N = 4  # samples per prompt


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok"), TINY_CHAT_TEMPLATE))


class ScriptedEngine:
    """Each request sleeps `delay`, or hangs (`hang(index)`) until aborted by rid; the sample index is read
    from the seed (sampling seed 0 + index). `deaf` ignores aborts; `fail` raises for those indices."""

    def __init__(self, hang=lambda i: False, delay=0.002, deaf=False, fail=()):
        self.hang, self.delay, self.deaf, self.fail = hang, delay, deaf, set(fail)
        self.replies, self.aborts, self.cancelled, self.group_requests = [], [], [], []
        self.running = self.max_running = 0
        self._aborted: dict[str, asyncio.Event] = {}

    async def generate(self, input_ids, sampling_params, *, rid=None, return_logprob=True):
        index = sampling_params["sampling_seed"]
        if index in self.fail:
            raise EngineError("http://fake/generate", 503, f"engine overloaded for sample {index}")
        event = self._aborted.setdefault(rid, asyncio.Event())
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.wait_for(event.wait(), None if self.hang(index) else self.delay)
            n, finish = 1, "abort"
        except TimeoutError:
            n, finish = 1 + index % 3, "stop" if index % 2 == 0 else "length"
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running -= 1
        output = [65 + k for k in range(n)]
        meta = {"id": rid, "finish_reason": {"type": finish}, "prompt_tokens": len(input_ids), "completion_tokens": n,
                "cached_tokens": 3, "weight_version": str(index % 2 + 6),
                "output_token_logprobs": [[-0.5, t, None] for t in output]}
        self.replies.append((index, meta))
        return GenerateResult.from_reply({"text": "", "output_ids": output, "meta_info": meta})

    async def generate_samples(self, input_ids, sampling_params, n, *, rid=None, return_logprob=True):
        """`rollout.request_per = "group"`: one request of n samples, sample i as `{rid}_{i}`, seed + i."""
        self.group_requests.append(rid)
        seed = sampling_params["sampling_seed"]
        return list(await asyncio.gather(*(self.generate(input_ids, {**sampling_params, "sampling_seed": seed + i},
                                                         rid=f"{rid}_{i}") for i in range(n))))

    async def abort(self, rid):
        self.aborts.append(rid)
        if not self.deaf:
            for key in [rid, *(key for key in self._aborted if key.startswith(rid + "_"))]:
                self._aborted.setdefault(key, asyncio.Event()).set()

    def was_aborted(self, rid):
        """Whether `rid`, or the request of n samples it is one of, was aborted."""
        return rid in self.aborts or rid.rsplit("_", 1)[0] in self.aborts


async def parity_reward(sample):
    """Odd groups: 0/1 by sample parity (informative); even groups: all 1.0 (zero variance, filtered)."""
    return float(sample.index % 2) if sample.group_index % 2 else 1.0


def make_ctx(tokenizer, engine, n_prompts=30, reward_fn=parity_reward, reward=None, **rollout_kw):
    prompts = [Sample(prompt=f"{i}+1=", label=str(i + 1)) for i in range(n_prompts)]
    cfg = RolloutConfig(n_samples_per_prompt=N, sampling=SamplingConfig(seed=0), **rollout_kw)
    return RolloutContext(engine=engine, tokenizer=tokenizer, rollout=cfg, reward=reward or RewardConfig(),
                          source=PromptSource(prompts, shuffle=False), reward_fn=reward_fn)


def rows(groups):
    return [g[0].metadata["data_index"] for g in groups]


@pytest.mark.parametrize("request_per", ["sample", "group"])
def test_over_sampling_filter_abort_and_return_to_source(tokenizer, request_per):
    # round 1: groups 0, 1, 2 (1 passes); round 2: 3 passes and fills the batch while 4 and 5 hang
    engine = ScriptedEngine(hang=lambda i: i >= 4 * N)
    ctx = make_ctx(tokenizer, engine, batch_size=2, over_sampling_batch_size=3, dynamic_filter="zero_std",
                   return_partial_to_source=True, request_per=request_per)
    batch = asyncio.run(rollout(ctx, 2))
    assert [g[0].group_index for g in batch.groups] == [1, 3]
    hung = {rid for rid, index in ((m["id"], i) for i, m in engine.replies) if index >= 4 * N}
    assert len(hung) == 2 * N and all(engine.was_aborted(rid) for rid in hung)  # every leftover aborted by rid
    assert len(engine.group_requests) == (6 if request_per == "group" else 0)  # one request a group
    assert ctx.source.state_dict()["returned"] == [4, 5] and ctx.state.in_flight == {} and not ctx.state.stopped
    m = batch.metrics
    assert (m["rollout/launched_groups"], m["rollout/kept_groups"], m["rollout/over_sampling_rounds"]) == (6, 2, 2)
    assert m["rollout/zero_std_groups_dropped"] == m["rollout/filtered_groups"] == 2
    assert m["rollout/aborted_groups"] == m["rollout/returned_groups"] == 2 and m["rollout/failed_groups"] == 0
    # the next step serves the returned prompts first
    assert rows(ctx.source.next_groups(2, N)) == [4, 5]


@pytest.mark.parametrize("request_per", ["sample", "group"])
def test_metrics_match_the_samples(tokenizer, request_per):
    engine = ScriptedEngine()
    ctx = make_ctx(tokenizer, engine, batch_size=3, over_sampling_batch_size=5, dynamic_filter="zero_std",
                   request_per=request_per)
    batch = asyncio.run(rollout(ctx, 3))
    samples, m = batch.samples, batch.metrics
    rewards = [s.reward for s in samples]
    assert [g[0].group_index for g in batch.groups][:2] == [1, 3]  # the third: whichever odd group ended first
    assert all(g[0].group_index % 2 for g in batch.groups)
    assert m["rollout/reward_mean"] == pytest.approx(statistics.fmean(rewards)) == 0.5
    assert m["rollout/reward_std"] == pytest.approx(statistics.pstdev(rewards))
    assert m["rollout/response_length_mean"] == pytest.approx(statistics.fmean(s.response_length for s in samples))
    assert m["rollout/truncated_ratio"] == sum(s.status is Status.TRUNCATED for s in samples) / len(samples) == 0.5
    versions = [int(s.weight_versions[0]) for s in samples]
    assert m["rollout/weight_version_mean"] == pytest.approx(statistics.fmean(versions))
    assert m["rollout/mixed_version_ratio"] == 0.0
    prompt_tokens = sum(meta["prompt_tokens"] for _, meta in engine.replies)
    assert m["rollout/prefix_cache_hit_rate"] == pytest.approx(3 * len(engine.replies) / prompt_tokens)
    assert m["rollout/raw_reward_mean"] > m["rollout/reward_mean"]  # filtered groups scored 1.0
    assert m["time/rollout_s"] > 0 and m["perf/rollout_tokens_per_s"] > 0
    for s in samples:
        assert s.tokens[-s.response_length:] == [65 + k for k in range(s.response_length)]


def test_mixed_versions_and_empty_steps_in_step_metrics():
    s = Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_logprobs=[0.0], reward=1.0,
               status=Status.COMPLETED, weight_versions=["2", "4"])
    m = step_metrics([[s]], [], [[s]], elapsed_s=2.0, zero_std=False)
    assert m["rollout/mixed_version_ratio"] == 1.0 and m["rollout/weight_version_mean"] == 3.0
    assert m["perf/rollout_tokens_per_s"] == 0.5 and "rollout/prefix_cache_hit_rate" not in m


def test_a_step_that_cannot_fill_its_batch_fails_with_the_counts(tokenizer):
    async def constant(sample):
        return 1.0

    ctx = make_ctx(tokenizer, ScriptedEngine(), reward_fn=constant, batch_size=2, over_sampling_batch_size=2,
                   dynamic_filter="zero_std")
    ctx.max_rounds = 3
    with pytest.raises(RolloutError, match=r"after 3 rounds .* 6 launched, [01] still generating\) only 0 of 2 "
                                           r"groups passed: [56] dropped by rollout.dynamic_filter = 'zero_std'"):
        asyncio.run(rollout(ctx, 2))
    assert ctx.state.in_flight == {}


def test_failed_groups_are_dropped_and_not_returned(tokenizer):
    async def reward(sample):
        if sample.group_index == 2:
            raise RewardError("no label")
        return await parity_reward(sample)

    prompts = [Sample(prompt="x" * 300), *(Sample(prompt=f"{i}+1=") for i in range(20))]  # row 0 is too long
    engine = ScriptedEngine(fail={1 * N + 1})  # group 1: one sample's request fails
    cfg = RolloutConfig(n_samples_per_prompt=N, sampling=SamplingConfig(seed=0), batch_size=1,
                        over_sampling_batch_size=4, return_partial_to_source=True)
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, reward_fn=reward, rollout=cfg,
                         source=PromptSource(prompts, shuffle=False))
    batch = asyncio.run(rollout(ctx, 1))
    assert [g[0].group_index for g in batch.groups] == [3]
    m = batch.metrics
    assert m["rollout/failed_groups"] == 3 and m["rollout/prompt_too_long"] == N
    assert m["rollout/aborted_groups"] == 0 and ctx.source.state_dict()["returned"] == []


def test_deaf_engine_requests_are_cancelled_after_the_abort_timeout(tokenizer):
    engine = ScriptedEngine(hang=lambda i: i >= N, deaf=True)
    ctx = make_ctx(tokenizer, engine, batch_size=1, over_sampling_batch_size=2)
    ctx.abort_timeout_s = 0.3
    batch = asyncio.run(rollout(ctx, 1))
    assert batch.metrics["rollout/aborted_groups"] == 1 and batch.metrics["rollout/returned_groups"] == 0
    assert len(engine.cancelled) == N and len(engine.aborts) > N  # aborts re-sent until the timeout
    assert ctx.state.in_flight == {}


@pytest.mark.parametrize("request_per", ["sample", "group"])
def test_cancelling_a_step_aborts_its_requests(tokenizer, request_per):
    engine = ScriptedEngine(hang=lambda i: True)
    ctx = make_ctx(tokenizer, engine, batch_size=2, request_per=request_per)

    async def main():
        task = asyncio.create_task(rollout(ctx, 2))
        while engine.running < 2 * N:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    requests = 2 * N if request_per == "sample" else 2
    assert len(set(engine.aborts)) == requests and engine.running == 0 and ctx.state.in_flight == {}


def test_group_reward_and_concurrency_limit(tokenizer):
    calls = []

    async def group_reward(samples):
        calls.append([s.index for s in samples])
        return [float(i) for i in range(len(samples))]

    engine = ScriptedEngine(delay=0.01)
    ctx = make_ctx(tokenizer, engine, reward_fn=group_reward, reward=RewardConfig(group=True), batch_size=3,
                   concurrency=5)
    batch = asyncio.run(rollout(ctx, 3))
    assert sorted(calls) == [[s.index for s in g] for g in batch.groups]
    assert [s.reward for s in batch.groups[0]] == [0.0, 1.0, 2.0, 3.0]
    assert engine.max_running == 5


@pytest.mark.parametrize("request_per", ["sample", "group"])
def test_worker_hooks_drive_the_fully_async_worker(tokenizer, request_per):
    engine = ScriptedEngine(fail={2 * N})
    ctx = make_ctx(tokenizer, engine, batch_size=2, dynamic_filter="zero_std", request_per=request_per)
    hooks = worker_hooks(ctx)
    assert hooks.finish_group is None  # per-sample rewards
    assert (hooks.generate_group is None) == (request_per == "sample") != (hooks.generate_sample is None)

    async def main():
        buffer = FifoBuffer(4, group_filter=ctx.group_filter)
        worker = AsyncRolloutWorker(ctx.source, buffer, n_samples_per_prompt=N, max_in_flight=2 * N,
                                    granularity=request_per, generate_sample=hooks.generate_sample,
                                    generate_group=hooks.generate_group)
        worker.start()
        groups = await worker.take(2, current_version=7)
        await worker.stop()
        return groups, buffer.metrics(), worker.metrics()

    groups, buffer_metrics, worker_metrics = asyncio.run(main())
    assert all(g[0].group_index % 2 == 1 and g[0].group_index != 2 for g in groups)
    assert all(s.reward == s.index % 2 for g in groups for s in g)
    assert buffer_metrics["buffer/dropped_filtered_total"] >= 1 and buffer_metrics["buffer/dropped_aborted_total"] == 1
    # the engine error reached the worker's counter: one sample, or the group of the one request
    assert worker_metrics["rollout/generate_errors_total"] == (1 if request_per == "sample" else N)


def test_abort_in_flight_ends_the_worker_requests_by_rid(tokenizer):
    engine = ScriptedEngine(hang=lambda i: True)
    ctx = make_ctx(tokenizer, engine, batch_size=2)

    async def main():
        buffer = FifoBuffer(4)
        worker = AsyncRolloutWorker(ctx.source, buffer, n_samples_per_prompt=N, max_in_flight=2 * N,
                                    generate_sample=worker_hooks(ctx).generate_sample)
        worker.start()
        while engine.running < 2 * N:
            await asyncio.sleep(0.01)
        worker.pause()
        aborted = await abort_in_flight(ctx)
        async with asyncio.timeout(10):
            while buffer.metrics()["buffer/dropped_aborted_total"] < 2:  # the aborted groups reach the buffer
                await asyncio.sleep(0.01)
        await worker.stop()
        return aborted, buffer.metrics()

    aborted, metrics = asyncio.run(main())
    assert aborted == 2 * N and engine.cancelled == [] and ctx.state.in_flight == {}
    assert metrics["buffer/dropped_aborted_total"] == 2  # every aborted group discarded on put


def test_run_rollout_dumps_and_load_dump_restores(tokenizer, tmp_path):
    ctx = make_ctx(tokenizer, ScriptedEngine(), batch_size=2, dynamic_filter="zero_std")
    ctx.dump_dir = tmp_path / "dump"
    first = asyncio.run(run_rollout(ctx, 2))
    asyncio.run(run_rollout(ctx, 2))
    assert sorted(p.name for p in ctx.dump_dir.iterdir()) == [
        "rollout_000000.samples", "rollout_000000.samples.json", "rollout_000001.samples",
        "rollout_000001.samples.json"]
    loaded = load_dump(ctx.dump_dir / "rollout_000000.samples")
    assert [[s.to_dict() for s in g] for g in loaded.groups] == [[s.to_dict() for s in g] for g in first.groups]
    assert loaded.metrics == first.metrics


def test_a_generation_cut_short_by_shutdown_is_aborted_quietly(caplog):
    from verst.rollout.rollout_fn import generate_and_reward

    async def closed_client(ctx, sample):
        raise RuntimeError("Cannot send a request, as the client has been closed.")

    ctx = RolloutContext(engine=None, tokenizer=None, generate_fn=closed_client, reward_fn=lambda s: 1.0)
    noisy = asyncio.run(generate_and_reward(ctx, Sample(tokens=[1], index=0, group_index=0)))
    assert noisy.status is Status.ABORTED and "generate fn raised" in noisy.metadata["generate_error"]
    assert "generate fn failed for sample 0" in caplog.text
    caplog.clear()
    asyncio.run(ctx.aclose())
    quiet = asyncio.run(generate_and_reward(ctx, Sample(tokens=[1], index=1, group_index=0)))
    assert quiet.status is Status.ABORTED and "shut down during generation" in quiet.metadata["generate_error"]
    assert caplog.text == ""
