"""Request batching: single-prompt /generate calls made together travel as one batched request, each
caller gets its own reply, a bad prompt fails only its caller, and cancelled callers are handled."""

from __future__ import annotations

import asyncio

import pytest

from verst.inference_client.batching import BatchReplyError, RequestBatcher
from verst.inference_client.client import EngineError
from verst.inference_client.protocol import BatchGenerateRequest, is_batch


class FakeEngine:
    """Answers a body (or a batch) with the reply a real engine's shape would have; refuses prompt [0]."""

    def __init__(self, delay: float = 0.0):
        self.bodies: list[tuple[dict, dict | None]] = []
        self.delay = delay
        self.cancelled = 0

    async def send(self, body, headers):
        self.bodies.append((body, headers))
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(body["input_ids"][0], list):
            if [0] in body["input_ids"]:
                raise EngineError("http://e/generate", 400, "input_ids = [0]: refused")
            return [{"output_ids": ids[::-1], "rid": rid} for ids, rid in zip(body["input_ids"], body["rid"])]
        if body["input_ids"] == [0]:
            raise EngineError("http://e/generate", 400, "input_ids = [0]: refused")
        return {"output_ids": body["input_ids"][::-1], "rid": body["rid"]}


def body(ids, rid, **flags):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "rid": rid, "return_logprob": True, **flags}


def test_calls_made_together_share_one_request_and_get_their_own_replies():
    engine = FakeEngine()

    async def main():
        batcher = RequestBatcher(engine.send, max_batch=8)
        replies = await asyncio.gather(*(batcher.submit(body([i, i + 1], f"r{i}")) for i in range(1, 6)))
        return batcher, replies

    batcher, replies = asyncio.run(main())
    assert replies == [{"output_ids": [i + 1, i], "rid": f"r{i}"} for i in range(1, 6)]
    assert batcher.requests_sent == 1 and len(engine.bodies) == 1
    sent, _ = engine.bodies[0]
    assert sent["input_ids"] == [[i, i + 1] for i in range(1, 6)] and sent["rid"] == [f"r{i}" for i in range(1, 6)]
    assert sent["sampling_params"] == [{"max_new_tokens": 4}] * 5 and sent["return_logprob"] is True


def test_batches_are_capped_and_split_by_headers_and_flags():
    engine = FakeEngine()

    async def main():
        batcher = RequestBatcher(engine.send, max_batch=3)
        calls = [batcher.submit(body([i], f"a{i}")) for i in range(1, 8)]  # 7 alike: 3 + 3 + 1
        calls += [batcher.submit(body([9], "k"), {"X-SMG-Routing-Key": "s1"})]
        calls += [batcher.submit(body([9], "f", top_logprobs_num=2))]
        calls += [batcher.submit(body([9], f"p{i}", priority=1)) for i in range(2)]  # a batch of their own
        await asyncio.gather(*calls)
        return batcher

    batcher = asyncio.run(main())
    sizes = sorted(len(b["input_ids"]) if isinstance(b["input_ids"][0], list) else 1 for b, _ in engine.bodies)
    assert sizes == [1, 1, 1, 2, 3, 3] and batcher.requests_sent == 6
    assert [b["rid"] for b, _ in engine.bodies if b.get("priority") == 1] == [["p0", "p1"]]
    assert [h for b, h in engine.bodies if h] == [{"X-SMG-Routing-Key": "s1"}]


def test_calls_naming_different_lora_adapters_share_one_request_with_one_name_per_prompt():
    engine = FakeEngine()

    async def main():
        batcher = RequestBatcher(engine.send, max_batch=8)
        await asyncio.gather(*(batcher.submit(body([i], f"r{i}", lora_path=name))
                               for i, name in enumerate(["a", "b", "a"], start=1)))

    asyncio.run(main())
    sent, _ = engine.bodies[0]
    assert len(engine.bodies) == 1 and sent["lora_path"] == ["a", "b", "a"]
    assert [one.lora_path for one in BatchGenerateRequest.model_validate(sent).prompts()] == ["a", "b", "a"]


def test_a_refused_prompt_fails_only_its_caller():
    engine = FakeEngine()

    async def main():
        batcher = RequestBatcher(engine.send, max_batch=8)
        return await asyncio.gather(*(batcher.submit(body(ids, f"r{n}")) for n, ids in enumerate([[1], [0], [2]])),
                                    return_exceptions=True)

    first, bad, third = asyncio.run(main())
    assert first == {"output_ids": [1], "rid": "r0"} and third == {"output_ids": [2], "rid": "r2"}
    assert isinstance(bad, EngineError) and bad.status == 400 and "input_ids = [0]" in str(bad)
    assert len(engine.bodies) == 4  # the batch, then each prompt alone


def test_an_engine_failure_reaches_every_caller_and_a_short_reply_is_an_error():
    async def down(body, headers):
        raise EngineError("http://e/generate", None, "ConnectError: refused")

    async def short(body, headers):
        return [{"output_ids": []}]

    async def main(send):
        batcher = RequestBatcher(send, max_batch=4)
        return await asyncio.gather(*(batcher.submit(body([i], f"r{i}")) for i in (1, 2)), return_exceptions=True)

    assert all(isinstance(e, EngineError) and "ConnectError" in str(e) for e in asyncio.run(main(down)))
    assert all(isinstance(e, BatchReplyError) and "batch of 2 prompts" in str(e) for e in asyncio.run(main(short)))


def test_cancelled_callers_leave_the_others_waiting_and_all_gone_cancels_the_request():
    engine = FakeEngine(delay=0.2)

    async def main():
        batcher = RequestBatcher(engine.send, max_batch=8)
        kept = asyncio.ensure_future(batcher.submit(body([1], "keep")))
        dropped = asyncio.ensure_future(batcher.submit(body([2], "drop")))
        await asyncio.sleep(0.05)
        dropped.cancel()
        reply = await kept
        assert engine.cancelled == 0
        gone = [asyncio.ensure_future(batcher.submit(body([i], f"g{i}"))) for i in (3, 4)]
        await asyncio.sleep(0.05)
        for task in gone:
            task.cancel()
        await asyncio.sleep(0.05)
        return reply

    assert asyncio.run(main()) == {"output_ids": [1], "rid": "keep"}
    assert engine.cancelled == 1  # the second request, once both its callers were gone


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_batch must be >= 2, got 1"):
        RequestBatcher(FakeEngine().send, max_batch=1)

    async def main():
        await RequestBatcher(FakeEngine().send, max_batch=2).submit(body([[1], [2]], ["a", "b"]))

    with pytest.raises(ValueError, match="single-prompt bodies"):
        asyncio.run(main())


def test_the_wire_model_splits_a_batch_and_checks_per_prompt_lists_by_name():
    raw = {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 5}],
           "rid": ["a", "b"], "return_logprob": True}
    assert is_batch(raw) and not is_batch({"input_ids": [1, 2]}) and not is_batch({"input_ids": []})
    one, two = BatchGenerateRequest.model_validate(raw).prompts()
    assert (one.input_ids, one.rid, one.sampling_params.max_new_tokens) == ([1, 2], "a", 2)
    assert (two.input_ids, two.rid, two.sampling_params.max_new_tokens, two.return_logprob) == ([3], "b", 5, True)
    shared = BatchGenerateRequest.model_validate({"text": ["x", "y"], "sampling_params": {"temperature": 0}})
    assert is_batch({"text": ["x", "y"]}) and [p.text for p in shared.prompts()] == ["x", "y"]
    assert [p.sampling_params.temperature for p in shared.prompts()] == [0, 0]
    urgent = BatchGenerateRequest.model_validate({"input_ids": [[1], [2]], "priority": 3})
    assert [p.priority for p in urgent.prompts()] == [3, 3]
    for bad, message in [
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid is a list of 1 for a batch of 2 prompts"),
        ({"input_ids": [[1], [2]], "stream": True}, "stream = true is for a single prompt, not a batch of 2"),
        ({"text": []}, "at least one prompt"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"n": 2}]}, "sampling_params.n = 2 is for a single prompt"),
        ({"input_ids": [[1], [2]], "priority": [1, 2]}, "priority"),
        ({"input_ids": [[1], [2]], "priority": 2**31}, "priority"),
    ]:
        with pytest.raises(ValueError, match=message):
            BatchGenerateRequest.model_validate(bad)
