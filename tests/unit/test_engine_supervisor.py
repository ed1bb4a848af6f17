"""The engine supervisor's restart steps with stand-in engines and rollout manager: where a restarted engine's
weights come from, when it rejoins the router, and one restart however many callers find the engine dead."""

from __future__ import annotations

import asyncio
import concurrent.futures

from verst.config.schema import FaultConfig
from verst.orchestration import health
from verst.orchestration.health import EngineSupervisor, RestartWeights
from verst.run.weights import RestartSource

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


class Done:
    """A finished Ray object reference, as `_ray` awaits it."""

    def future(self):
        future = concurrent.futures.Future()
        future.set_result(None)
        return future


class Method:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, *args))
        return Done()


class StandIns:
    """Engines, rollout manager (router membership) and the supervisor's callbacks, recording every call."""

    def __init__(self, served, restart_at):
        self.calls, self.served, self.restart_at = [], served, restart_at
        self.actor = type("Actor", (), {"remove_engine": Method(self.calls, "remove"),
                                        "add_engine": Method(self.calls, "add")})()

    def halt(self, index):
        self.calls.append(("halt", index))

    def restart(self, index, model, version):
        self.calls.append(("restart", index, model, version))

    async def restart_weights(self):
        await asyncio.sleep(0.05)  # a second caller arrives meanwhile
        return RestartWeights("RUN/weights/restart", self.restart_at)

    def supervisor(self):
        return EngineSupervisor(FaultConfig(), self, self, URLS, None, None, self.restart_weights,
                                served_version=lambda: self.served,
                                on_restart=lambda: self.calls.append(("reconnect",)))


async def no_check(url, version):
    return None


def test_an_engine_restarted_at_the_served_version_rejoins_at_once(monkeypatch):
    monkeypatch.setattr(health, "_check_version", no_check)
    parts = StandIns(served=3, restart_at=3)
    supervisor = parts.supervisor()

    async def two_callers():
        return await asyncio.gather(supervisor._recover(1, "dead"), supervisor._recover(1, "dead"))

    assert asyncio.run(two_callers()) == [True, True]
    assert parts.calls == [("remove", URLS[1]), ("halt", 1), ("restart", 1, "RUN/weights/restart", 3),
                           ("reconnect",), ("add", URLS[1])]  # one restart for both callers
    metrics = supervisor.metrics()
    assert metrics["fault/engine_restarts_total"] == 1 and metrics["fault/recovery_seconds"] > 0


def test_an_engine_restarted_ahead_of_the_others_rejoins_with_the_next_push(monkeypatch):
    monkeypatch.setattr(health, "_check_version", no_check)
    parts = StandIns(served=2, restart_at=3)  # the trainer took a step since the last push
    supervisor = parts.supervisor()
    assert asyncio.run(supervisor._recover(0, "dead"))
    assert ("add", URLS[0]) not in parts.calls
    assert "fault/recovery_seconds" not in supervisor.metrics()
    asyncio.run(supervisor.admit_synced(3))
    assert parts.calls[-1] == ("add", URLS[0])
    assert supervisor.metrics()["fault/recovery_seconds"] > 0
    asyncio.run(supervisor.admit_synced(4))  # admitted once
    assert parts.calls.count(("add", URLS[0])) == 1


def test_where_a_restarted_engine_gets_its_weights(tmp_path):
    from types import SimpleNamespace

    from verst.config import load_config
    from verst.sync.disk import snapshot_path
    from verst.trainer.backend import export_at_step

    exported = []

    class Trainer:
        def apply(self, fn, directory, merge_lora):
            exported.append((fn, directory, merge_lora))
            return [5, 5]  # the steps each rank's weights have taken

    def weights(transport, version):
        cfg = load_config(None, ["--sync.transport", transport, "--model.path", "MODEL"])
        return asyncio.run(RestartSource(cfg, SimpleNamespace(version=version), Trainer(), tmp_path / "weights")())

    assert weights("distributed", None) == RestartWeights("MODEL", 0)  # before the first push
    assert weights("disk", 4) == RestartWeights(str(snapshot_path(tmp_path / "weights", 4)), 4)
    assert exported == []
    for transport in ("distributed", "tensor"):
        assert weights(transport, 4) == RestartWeights(str(tmp_path / "weights" / "restart"), 5)
    assert exported == [(export_at_step, str(tmp_path / "weights" / "restart"), False)] * 2


def test_with_lora_adapter_sync_a_restarted_engine_loads_the_base_then_the_adapter(tmp_path):
    from types import SimpleNamespace

    from verst.config import load_config
    from verst.sync.disk import snapshot_path
    from verst.trainer.backend import export_at_step

    exported = []

    class Trainer:
        def apply(self, fn, directory, merge_lora):
            exported.append((fn, directory, merge_lora))
            return [5]

    def weights(transport, version):
        cfg = load_config(None, ["--sync.transport", transport, "--model.path", "MODEL", "--lora.enabled", "true"])
        return asyncio.run(RestartSource(cfg, SimpleNamespace(version=version), Trainer(), tmp_path / "weights")())

    assert weights("distributed", None) == RestartWeights("MODEL", 0)  # before the step-0 adapter's push
    assert weights("disk", 0) == RestartWeights("MODEL", 0, ("policy", str(snapshot_path(tmp_path / "weights", 0))))
    assert weights("disk", 4) == RestartWeights("MODEL", 4, ("policy", str(snapshot_path(tmp_path / "weights", 4))))
    restart = str(tmp_path / "weights" / "restart")
    assert weights("tensor", 0) == RestartWeights("MODEL", 5, ("policy", restart))  # the adapter export, no merge
    assert exported == [(export_at_step, restart, False)]


def test_with_multi_lora_a_restarted_engine_loads_every_adapter_and_every_router_learns_of_it(tmp_path,
                                                                                              monkeypatch):
    from types import SimpleNamespace

    from verst.config import VerstConfig
    from verst.trainer.backend import export_at_step

    exported = []

    class Trainer:
        def apply(self, fn, directory, merge_lora):
            exported.append((fn, directory, merge_lora))
            return [6]

    cfg = VerstConfig.model_validate({"schedule": "fully_async", "model": {"path": "MODEL"}, "sync": {"transport": "disk"},
                                      "lora": {"enabled": True, "adapters": [{"name": "add"}, {"name": "rev"}]}})
    restart = tmp_path / "weights" / "restart"
    weights = asyncio.run(RestartSource(cfg, SimpleNamespace(version=4), Trainer(), tmp_path / "weights")())
    assert weights == RestartWeights("MODEL", 6, adapters=(("add", str(restart / "add")), ("rev", str(restart / "rev"))))
    assert weights.loaded_adapters == [("add", str(restart / "add")), ("rev", str(restart / "rev"))]
    assert exported == [(export_at_step, str(restart), False)]  # the trainer's adapters, whatever the transport

    # one rollout manager per adapter: each one's router takes the engine out and back
    monkeypatch.setattr(health, "_check_version", no_check)
    loaded = []

    async def load_adapter(url, name, path):
        loaded.append((url, name))

    monkeypatch.setattr(health, "_load_adapter", load_adapter)
    first, second = StandIns(served=3, restart_at=3), StandIns(served=3, restart_at=3)

    async def multi_weights():
        return RestartWeights("MODEL", 3, adapters=(("add", "A"), ("rev", "R")))

    supervisor = EngineSupervisor(FaultConfig(), first, [first, second], URLS, None, None, multi_weights,
                                  served_version=lambda: 3)
    assert asyncio.run(supervisor._recover(1, "dead"))
    assert loaded == [(URLS[1], "add"), (URLS[1], "rev")]
    for parts in (first, second):
        assert ("remove", URLS[1]) in parts.calls and ("add", URLS[1]) in parts.calls
