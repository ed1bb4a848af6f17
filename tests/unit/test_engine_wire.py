"""The engine client's wires against simulated engines: a generation's timeout without a timer of its own, and the
fan-out of one control call to every engine, each failure named by its engine."""

import asyncio

import pytest

import verst.inference_client.wire as wire
from verst.inference_client.client import EngineClient, EngineError, Timeouts
from verst.inference_client.fleet import EngineFleet, FleetError
from verst.sim.config import SimConfig
from verst.sim.fleet import FleetSpec, SimFleet


async def fleet_of(count, speedup):
    sim = SimConfig(speedup=speedup, response_tokens_mean=100, response_tokens_sigma=0.0)
    fleet = SimFleet(FleetSpec(count=count, costs=sim.engine_costs_inputs(), speedup=speedup, model_path="m",
                               vocab_size=300, response_tokens_mean=100, response_tokens_sigma=0.0, max_running=64,
                               restart_s=0.0))
    ports = await fleet.start()
    return fleet, [f"http://127.0.0.1:{port}" for port in ports["engines"]]


@pytest.mark.parametrize("kind", ["pooled", "aiohttp"])
def test_a_long_request_is_timed_out_by_the_sweep_and_its_caller_is_not_left_cancelled(monkeypatch, kind):
    monkeypatch.setattr(wire, "SWEPT_FROM_S", 0.1)
    monkeypatch.setattr(wire, "SWEEP_S", 0.02)

    async def main():
        _, urls = await fleet_of(1, speedup=0.01)  # a reply would take minutes
        async with EngineClient(urls[0], timeouts=Timeouts(generate=0.2), wire=kind) as client:
            with pytest.raises(EngineError, match=r"timed out after 0.2s \(swept\)"):
                await client.generate([97] * 4, {"max_new_tokens": 50})
            assert asyncio.current_task().cancelling() == 0
            assert await client.get_weight_version() == "0"  # the client goes on

    asyncio.run(main())


def test_one_call_reaches_every_engine_and_a_dead_one_is_named():
    async def main():
        fleet, urls = await fleet_of(3, speedup=100.0)
        async with EngineFleet(urls) as engines:
            paused = await engines.pause("retract")
            assert sorted(paused) == sorted(urls) and all(r["success"] for r in paused.values())
            assert all(slot.engine.paused == "retract" for slot in fleet.slots)
            await engines.continue_generation()
            fleet.slot(1).fault("die", 1.0)
            with pytest.raises(FleetError) as failed:
                await engines.flush_cache()
            assert list(failed.value.failures) == [urls[1]] and "no reply" in str(failed.value)
            fleet.slot(2).fault("stall", 1.0)
            settled = await EngineFleet(urls, timeouts=Timeouts(control=0.3)).same_settled(
                lambda c: c.get_server_info())
            assert "timed out after 0.3s" in str(settled[urls[2]]) and settled[urls[0]]["engine"] == "verst-sim"

    asyncio.run(main())


def test_a_kept_connection_holds_no_reply_once_it_is_handed_on():
    """An idle kept-alive connection of the pooled wire holds no reply body (else every idle connection keeps its
    last reply's chunks: a thousand connections, a thousand replies)."""
    async def main():
        _, urls = await fleet_of(1, speedup=100.0)
        async with EngineClient(urls[0], wire="pooled") as client:
            result = await client.generate([97] * 4, {"max_new_tokens": 50})
            assert len(result.output_ids) == 50
            idle = client._wire._idle
            assert len(idle) == 1 and idle[0].body == []

    asyncio.run(main())
