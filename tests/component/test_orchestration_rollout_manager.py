"""The rollout manager as a plain class (no Ray, no router): it builds its parts once started, hosts the
fully async worker across calls on one event loop, keeps the two schedules' entry points apart, saves
and restores the data source, and hands leftovers back on shutdown.
"""

import asyncio
import threading

import pytest

from tests.fake_source import NumberedSource
from verst.rollout import AsyncRolloutWorker, FifoBuffer
from verst.rollout.manager import RolloutEndpoints, RolloutManager, RolloutParts
from verst.types import Sample, Status

N = 2  # samples per prompt


async def generate_sample(sample, version=3):
    await asyncio.sleep(0.001 if sample.group_index < 6 else 60)  # later groups never finish
    sample.tokens = sample.tokens + [7]
    sample.response_length, sample.loss_mask, sample.rollout_logprobs = 1, [1], [-0.5]
    sample.weight_versions.append(str(version))
    sample.status = Status.COMPLETED
    return sample


def parts_factory(seen):
    def factory(endpoints: RolloutEndpoints) -> RolloutParts:
        seen.append(endpoints)
        source = NumberedSource()
        buffer = FifoBuffer(capacity_groups=8)
        worker = AsyncRolloutWorker(source, buffer, n_samples_per_prompt=N, max_in_flight=4 * N,
                                    generate_sample=generate_sample,
                                    on_leftover=lambda group: source.return_prompts(group))
        return RolloutParts(worker=worker, buffer=buffer, source=source)

    return factory


def test_the_manager_hosts_the_fully_async_worker():
    async def main():
        seen = []
        manager = RolloutManager(["http://127.0.0.1:1/"], parts_factory(seen), router=None)
        with pytest.raises(RuntimeError, match="not started"):
            await manager.take(1, 3)
        assert await manager.start() is None
        assert seen == [RolloutEndpoints(router_url=None, engine_urls=["http://127.0.0.1:1"])]
        with pytest.raises(RuntimeError, match="not running"):
            await manager.take(1, 3)
        await manager.start_async()
        first = await manager.take(2, version=3, timeout=10)
        assert [g[0].group_index for g in first] == [0, 1]
        assert all(s.status == Status.COMPLETED and len(g) == N for g in first for s in g)
        with pytest.raises(RuntimeError, match="no generate_batch"):
            await manager.generate_batch(0, 3)
        await manager.pause()
        await manager.resume()
        more = await manager.take(4, version=4, timeout=10)
        assert [g[0].group_index for g in more] == [2, 3, 4, 5]
        metrics = await manager.metrics()
        assert metrics["buffer/staleness_max"] == 1.0 and metrics["rollout/groups_produced_total"] >= 6
        state = await manager.state_dict()
        assert state["position"] >= 6
        leftovers = await manager.shutdown()
        assert leftovers == 4  # the never-finishing groups in flight, returned to the source
        assert len(manager._parts.source.returned) == leftovers
        with pytest.raises(RuntimeError, match="shut down"):
            await manager.metrics()

    asyncio.run(main())


def test_a_train_batch_is_assembled_from_takes_and_handed_over_with_its_metrics():
    """The fully async driver takes a train batch in one call when its groups are ready; one that runs out of
    time hands over nothing yet, says how many groups it holds, and the next call completes the batch."""
    def factory(endpoints):
        parts = parts_factory([])(endpoints)
        parts.batch_metrics = lambda groups: {"rollout/groups": float(len(groups))}
        return parts

    async def main():
        manager = RolloutManager(["http://e"], factory, router=None)
        await manager.start()
        await manager.start_async()
        groups, (count, metrics) = await manager.take_batch(3, version=3, timeout=10)
        assert [g[0].group_index for g in groups] == [0, 1, 2] and count == 3
        assert metrics["rollout/groups"] == 3.0 and "buffer/staleness_max" in metrics
        groups, (held, metrics) = await manager.take_batch(10, version=3, timeout=0.5)  # a new batch began
        assert groups == [] and metrics is None and held == 3  # groups 3-5; the later ones never finish
        groups, (count, metrics) = await manager.take_batch(3, version=3, timeout=0.5)
        assert [g[0].group_index for g in groups] == [3, 4, 5] and count == 3 and metrics is not None
        await manager.shutdown()

    asyncio.run(main())


def test_a_sync_set_up_serves_generate_batch_and_refuses_the_worker_calls():
    async def generate_batch(rollout_id, weight_version):
        return [[Sample(tokens=[1], metadata={"rollout": rollout_id, "version": weight_version})]]

    async def main():
        manager = RolloutManager(["http://e"], lambda endpoints: RolloutParts(generate_batch=generate_batch),
                                 router=None)
        await manager.start()
        groups = await manager.generate_batch(5, 2)
        assert groups[0][0].metadata == {"rollout": 5, "version": 2}
        groups, summary = await manager.generate_train_batch(6, 3)  # a train batch: the groups and a summary
        assert groups[0][0].metadata == {"rollout": 6, "version": 3} and summary == (1, {})
        for call in (manager.start_async(), manager.pause(), manager.take(1, 0)):
            with pytest.raises(RuntimeError, match="no fully async worker"):
                await call
        assert await manager.shutdown() == 0

    asyncio.run(main())


def test_a_failing_parts_factory_is_reported_and_nothing_stays_up():
    async def main():
        manager = RolloutManager(["http://e"], lambda endpoints: "not parts", router=None)
        with pytest.raises(TypeError, match="returned str; expected RolloutParts"):
            await manager.start()
        with pytest.raises(RuntimeError, match="shut down"):
            await manager.metrics()

    asyncio.run(main())


def test_engine_urls_may_arrive_at_start_but_must_arrive_once():
    async def main():
        seen = []
        late = RolloutManager(None, parts_factory(seen), router=None)
        assert await late.engine_urls() == []
        with pytest.raises(ValueError, match="needs at least one engine URL: pass engine_urls"):
            await late.start()
        await late.start(["http://127.0.0.1:2/"])
        assert seen == [RolloutEndpoints(router_url=None, engine_urls=["http://127.0.0.1:2"])]
        assert await late.start(["http://127.0.0.1:2"]) is None  # idempotent with the same engines
        with pytest.raises(ValueError, match=r"engine_urls \['http://other'\] differ"):
            await late.start(["http://other"])
        with pytest.raises(ValueError, match="at least one engine URL, got \\[\\]"):
            RolloutManager([], parts_factory(seen), router=None)
        await late.shutdown()

    asyncio.run(main())


def test_prepare_runs_at_once_and_the_parts_are_built_after_it():
    async def main():
        events, release = [], threading.Event()

        def prepare():
            events.append("prepare started")
            release.wait(5)
            events.append("prepare done")

        def factory(endpoints):
            events.append("factory")
            return parts_factory([])(endpoints)

        manager = RolloutManager(None, factory, router=None, prepare=prepare)
        await asyncio.sleep(0.05)
        assert events == ["prepare started"]  # before any engine URL is known
        starting = asyncio.create_task(manager.start(["http://127.0.0.1:2"]))
        await asyncio.sleep(0.05)
        assert not starting.done() and events == ["prepare started"]  # start waits for it
        release.set()
        await starting
        assert events == ["prepare started", "prepare done", "factory"]
        await manager.shutdown()

    asyncio.run(main())


def test_a_failing_prepare_is_raised_by_start():
    def prepare():
        raise FileNotFoundError("model path '/nowhere' has no tokenizer.json")

    async def main():
        manager = RolloutManager(None, parts_factory([]), router=None, prepare=prepare)
        with pytest.raises(FileNotFoundError, match="/nowhere"):
            await manager.start(["http://127.0.0.1:2"])
        await manager.shutdown()

    asyncio.run(main())


def test_a_checkpoint_of_the_running_worker_hands_unfinished_groups_back_on_resume(tmp_path):
    """save_state while the worker generates: the buffer's groups come back in the buffer, the groups not in
    it are returned to the source of the resumed manager, the counters continue; the live run goes on."""
    async def main():
        manager = RolloutManager(["http://e"], parts_factory([]), router=None)
        await manager.start()
        await manager.start_async()
        assert len(await manager.take(2, version=3, timeout=10)) == 2
        while len(manager._parts.buffer) < 4:  # groups 2..5 finish, 6..9 never do
            await asyncio.sleep(0.01)
        counts = await manager.save_state(str(tmp_path / "rollout.pkl"))
        assert counts == {"buffer_groups": 4, "returned_in_flight_groups": 4}
        assert len(manager._parts.source.returned) == 0  # the live run keeps its groups
        await manager.shutdown()

        resumed = RolloutManager(["http://e"], parts_factory([]), router=None)
        await resumed.start()
        await resumed.load_state(str(tmp_path / "rollout.pkl"))
        parts = resumed._parts
        assert parts.source.position == 10 and sorted(parts.source.returned) == [6, 7, 8, 9]
        assert [g[0].group_index for g in parts.buffer.state_dict()["groups"]] == [2, 3, 4, 5]
        assert (await resumed.metrics())["rollout/groups_produced_total"] == 6
        await resumed.shutdown()

    asyncio.run(main())
