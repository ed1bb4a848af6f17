"""The async engine client against a fake transport: wire shapes, the routing-key rule, retries, errors."""

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest

from verst.inference_client.client import ROUTING_KEY_HEADER, EngineClient, EngineError, RoutingKeyError

REPLY = {
    "text": "hi", "output_ids": [5, 6],
    "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 6}, "prompt_tokens": 3,
                  "completion_tokens": 2, "cached_tokens": 1, "weight_version": "4",
                  "output_token_logprobs": [[-0.5, 5, None], [-1.25, 6, None]],
                  "routed_experts": base64.b64encode(np.arange(16, dtype=np.int32).tobytes()).decode()},
}


def fake(handler):
    calls = []

    def record(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return handler(request, len(calls))

    return httpx.MockTransport(record), calls


def test_generate_sends_sglang_fields_and_the_routing_key_header():
    transport, calls = fake(lambda req, n: httpx.Response(200, json=REPLY))

    async def main():
        async with EngineClient("http://engine", transport=transport) as client:
            return await client.generate([1, 2, 3], {"max_new_tokens": 2}, rid="r1", routing_key="session-9",
                                         return_routed_experts=True)

    result = asyncio.run(main())
    body = json.loads(calls[0].content)
    assert calls[0].url.path == "/generate" and calls[0].headers[ROUTING_KEY_HEADER] == "session-9"
    assert body == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                    "rid": "r1", "return_routed_experts": True}
    assert result.output_ids == [5, 6] and result.logprobs == [-0.5, -1.25]
    assert (result.finish_reason, result.matched, result.weight_version, result.cached_tokens) == ("stop", 6, "4", 1)
    assert result.routed_experts(top_k=2).shape == (4, 2, 2)  # prompt 3 + output 2 - 1 rows


def test_a_priority_travels_as_sglangs_top_level_field():
    transport, calls = fake(lambda req, n: httpx.Response(200, json=REPLY))

    async def main():
        async with EngineClient("http://engine", transport=transport) as client:
            await client.generate([1], {"max_new_tokens": 2}, priority=1)
            await client.generate([1], {"max_new_tokens": 2})

    asyncio.run(main())
    assert [json.loads(c.content).get("priority") for c in calls] == [1, None]


def test_affinity_without_a_routing_key_is_an_error_not_a_fallback():
    transport, calls = fake(lambda req, n: httpx.Response(200, json=REPLY))

    async def main():
        async with EngineClient("http://router", transport=transport, affinity=True) as client:
            with pytest.raises(RoutingKeyError, match="routing_key"):
                await client.generate([1])
            async with EngineClient("http://router", transport=transport) as plain:
                with pytest.raises(RoutingKeyError):
                    await plain.generate([1], needs_affinity=True)
                await plain.generate([1])  # no affinity needed: fine without a key

    asyncio.run(main())
    assert len(calls) == 1 and ROUTING_KEY_HEADER.lower() not in calls[0].headers


def test_gets_are_retried_but_posts_are_not():
    def flaky(request, n):
        if n <= 2 or request.method == "POST":
            return httpx.Response(503, json={"error": {"message": "warming up"}})
        return httpx.Response(200, json={"weight_version": "3"})

    transport, calls = fake(flaky)

    async def main():
        async with EngineClient("http://e", transport=transport) as client:
            assert await client.get_weight_version() == "3"
            with pytest.raises(EngineError, match="warming up|503"):
                await client.pause("retract")

    asyncio.run(main())
    assert [c.method for c in calls] == ["GET", "GET", "GET", "POST"]


def test_errors_carry_url_status_and_the_servers_message():
    body = {"error": {"message": "input_ids = 999: token id outside the vocabulary [0, 265)", "field": "input_ids"}}
    transport, _ = fake(lambda req, n: httpx.Response(400, json=body))

    def down(request):
        raise httpx.ConnectError("refused")

    async def main():
        async with EngineClient("http://e", transport=transport) as client:
            with pytest.raises(EngineError) as info:
                await client.generate([999])
            assert info.value.status == 400 and "outside the vocabulary" in info.value.message
            assert info.value.url == "http://e/generate"
        async with EngineClient("http://gone", transport=httpx.MockTransport(down), get_retries=1) as client:
            assert await client.health() is False
            with pytest.raises(EngineError, match="ConnectError"):
                await client.get_load()
            with pytest.raises(EngineError, match="no reply"):
                await client.abort_all()

    asyncio.run(main())


def test_a_generation_whose_engine_went_away_is_sent_again_when_asked():
    def router(request, n):
        if n == 1:
            raise httpx.ConnectError("connection refused", request=request)
        if n == 2:
            return httpx.Response(502, json={"error": {"message": "worker unreachable"}})
        if n == 3:
            return httpx.Response(500, text="error sending request for url (http://e1/generate). URL: http://e1")
        if n == 4:
            return httpx.Response(200, json=REPLY)
        if n == 5:
            return httpx.Response(500, json={"error": {"message": "out of memory"}})
        return httpx.Response(400, json={"error": {"message": "bad request"}})

    transport, calls = fake(router)

    async def main():
        async with EngineClient("http://r", transport=transport, generate_retries=3, retry_backoff_s=0.01) as client:
            assert (await client.generate([1, 2, 3])).output_ids == [5, 6]
            assert client.retried == 3
            for message in ("out of memory", "bad request"):  # the engine's own errors: not sent again
                with pytest.raises(EngineError, match=message):
                    await client.generate([1])
            assert client.retried == 3

    asyncio.run(main())
    assert len(calls) == 6


def test_without_retries_a_lost_engine_fails_the_generation():
    def gone(request, n):
        raise httpx.ConnectError("connection refused", request=request)

    transport, calls = fake(gone)

    async def main():
        async with EngineClient("http://r", transport=transport) as client:
            with pytest.raises(EngineError, match="ConnectError"):
                await client.generate([1])

    asyncio.run(main())
    assert len(calls) == 1


def sse(*events):
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})


def event(ids, n, finish=None):
    """One streamed event carrying `ids` (all so far, or only the new ones) with n completion tokens."""
    return {"text": "", "output_ids": ids, "meta_info": {
        "id": "r1", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": n, "weight_version": "4",
        "output_token_logprobs": [[-float(t), t, None] for t in ids]}}


@pytest.mark.parametrize("events", [
    [event([5], 1), event([5, 6], 2), event([5, 6, 7], 3, {"type": "stop", "matched": 7})],  # cumulative
    [event([5], 1), event([6], 2), event([7], 3, {"type": "stop", "matched": 7})],  # incremental
])
def test_a_streamed_generation_yields_every_id_so_far_in_either_form(events):
    transport, calls = fake(lambda req, n: sse(*events))

    async def main():
        async with EngineClient("http://engine", transport=transport) as client:
            return [r async for r in client.generate_stream([1, 2, 3], {"max_new_tokens": 3}, rid="r1",
                                                             routing_key="s1")]

    results = asyncio.run(main())
    body = json.loads(calls[0].content)
    assert body["stream"] is True and body["input_ids"] == [1, 2, 3] and calls[0].headers[ROUTING_KEY_HEADER] == "s1"
    assert [r.output_ids for r in results] == [[5], [5, 6], [5, 6, 7]]
    assert results[-1].logprobs == [-5.0, -6.0, -7.0] and results[-1].weight_version == "4"
    assert [r.finish_reason for r in results] == ["", "", "stop"]


@pytest.mark.parametrize("reply, words", [
    (lambda: sse(event([5], 1), {"error": {"message": "engine is shutting down"}}), "engine is shutting down"),
    (lambda: httpx.Response(422, json={"error": {"message": "sampling_params.top_k = 0: bad", "field":
                                                  "sampling_params.top_k"}}), "top_k = 0"),
    (lambda: httpx.Response(200, content=b"data: {not json\n\n"), "unreadable stream event"),
])
def test_a_streamed_generation_that_fails_raises_engine_error(reply, words):
    transport, _ = fake(lambda req, n: reply())

    async def main():
        async with EngineClient("http://engine", transport=transport) as client:
            return [r async for r in client.generate_stream([1], {})]

    with pytest.raises(EngineError, match=words) as err:
        asyncio.run(main())
    assert err.value.field in (None, "sampling_params.top_k")
