"""The engine thread's batched submission (`EngineRunner.generate_many`, behind a batched `/generate`):
every request finishes with its own tokens, the caller is woken once, a batch with a refused request
leaves nothing behind, and a caller that goes away aborts what is still running."""

import asyncio

import pytest
import torch

from verst.engine.core import EngineConfig, EngineCore
from verst.engine.request import Request
from verst.engine.runner import EngineRunner
from verst.inference_client.protocol import InvalidRequest, SamplingParams
from verst.models.factory import init_model
from verst.models.loader import load_model_and_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    return load_model_and_tokenizer(init_model("qwen3", "tiny", tmp_path_factory.mktemp("runner") / "m", seed=0))


@pytest.fixture
def runner(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    runner = EngineRunner(EngineCore(model, tokenizer, EngineConfig(max_running_requests=4)))
    runner.start()
    yield runner
    runner.stop()


def req(rid, n, prompt=(5, 6, 7, 8)):
    return Request(rid=rid, prompt_ids=list(prompt), return_logprob=True,
                   sampling=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))


def test_a_batch_finishes_every_request_and_wakes_the_caller_once(runner):
    reqs = [req(f"r{i}", n) for i, n in enumerate((1, 9, 3, 5, 2, 7))]  # more than the running slots

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kw: (wakeups.append(args[0]), original(*args, **kw))[1]
        try:
            done = await runner.generate_many(reqs)
        finally:
            loop.call_soon_threadsafe = original
        return done, [w for w in wakeups if getattr(w, "__name__", "") == "_resolve"]

    done, resolves = asyncio.run(main())
    assert done == reqs and [len(r.output_ids) for r in done] == [1, 9, 3, 5, 2, 7]
    assert all(r.finish.type == "length" and r.finished for r in done)
    assert len(resolves) == 1  # one wake-up for the batch, not one per request
    # greedy and the same prompt: every request's tokens are a prefix of the longest one's
    longest = done[1].output_ids
    assert all(r.output_ids == longest[: len(r.output_ids)] for r in done)


def test_a_batch_with_a_refused_request_leaves_nothing_running(runner):
    reqs = [req("a", 50), req("b", 50), req("a", 50)]  # the third reuses a rid still in flight

    async def main():
        with pytest.raises(InvalidRequest, match="rid"):
            await runner.generate_many(reqs)
        return await runner.acall(lambda core: (len(core.requests), len(core.waiting) + len(core.running)))

    assert asyncio.run(main()) == (0, 0)
    assert reqs[0].finish.type == "abort" and "another request of its batch" in reqs[0].finish.message
    assert asyncio.run(runner.generate(req("c", 2))).output_ids  # the engine serves on


def test_a_caller_that_goes_away_aborts_the_batch(runner):
    reqs = [req("x", 400), req("y", 1), req("z", 400)]

    async def main():
        task = asyncio.ensure_future(runner.generate_many(reqs))
        while not reqs[1].finished:  # the short one finishes; the others are still running
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if all(r.finished for r in reqs):
                break
            await asyncio.sleep(0.01)
        return await runner.acall(lambda core: len(core.requests))

    assert asyncio.run(main()) == 0
    assert [r.finish.type for r in reqs] == ["abort", "length", "abort"]
