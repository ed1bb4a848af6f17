"""Colocated engines give their device memory to the trainer around each step (`DeviceShare`); an engine that
dies on the way is restarted by the supervisor and the step goes on, its new server's memory handled as a
restarted engine holds it: released again before the step, left as it is during it."""

from __future__ import annotations

import asyncio
import time

import pytest

from verst.run.training import DeviceShare


class Engines:
    """Two engines whose servers may be dead (a call fails with the error a dead server's actor gives)."""

    def __init__(self) -> None:
        self.urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        self.released = [False, False]
        self.dead: set[int] = set()
        self.calls: list[tuple[str, list[int]]] = []

    def release_memory(self, indices):
        return self._each("release", indices, True)

    def resume_memory(self, indices):
        return self._each("resume", indices, False)

    def _each(self, what: str, indices, release: bool):
        self.calls.append((what, list(indices)))
        out = {}
        for i in indices:
            if i in self.dead:
                out[i] = RuntimeError(f"engine {i} failed in '{what}_memory': Connection refused")
            elif self.released[i] == release:
                out[i] = RuntimeError(f"engine {i} failed in '{what}_memory': 400 tags = ['weights']: already")
            else:
                self.released[i] = release
                out[i] = True
        return out


class Supervisor:
    """Restarts a dead engine when it probes (its new server holds its memory), as `EngineSupervisor` does."""

    def __init__(self, engines: Engines, restarts: bool = True):
        self.engines, self.restarts_engines, self.replaced_at, self.checks = engines, restarts, {}, 0

    async def check_now(self) -> None:
        self.checks += 1
        for i in sorted(self.engines.dead):
            self.restart(i)

    def restart(self, i: int) -> None:
        self.engines.dead.discard(i)
        self.engines.released[i] = False
        self.replaced_at[i] = time.perf_counter()

    def replaced_since(self, moment: float) -> set[int]:
        return {i for i, at in self.replaced_at.items() if at > moment}


async def nothing() -> None:
    return None


def turn(share: DeviceShare, during=lambda: None) -> None:
    async def main():
        async with share.trainer_turn():
            during()

    asyncio.run(main())


def test_every_engine_releases_for_the_step_and_resumes_after_it():
    engines = Engines()
    seen = []
    turn(DeviceShare(engines, nothing, Supervisor(engines)), lambda: seen.append(list(engines.released)))
    assert seen == [[True, True]] and engines.released == [False, False]
    assert engines.calls == [("release", [0, 1]), ("resume", [0, 1])]


def test_an_engine_dead_at_the_release_is_restarted_and_its_new_server_releases_too():
    engines = Engines()
    supervisor = Supervisor(engines)
    engines.dead.add(1)
    seen = []
    turn(DeviceShare(engines, nothing, supervisor), lambda: seen.append(list(engines.released)))
    assert supervisor.checks == 1 and seen == [[True, True]] and engines.released == [False, False]
    assert engines.calls == [("release", [0, 1]), ("release", [1]), ("resume", [0, 1])]


def test_an_engine_that_dies_during_the_step_is_restarted_holding_its_memory_and_not_resumed():
    engines = Engines()
    supervisor = Supervisor(engines)
    turn(DeviceShare(engines, nothing, supervisor), lambda: engines.dead.add(1))  # killed while the trainer steps
    assert supervisor.checks == 1 and engines.released == [False, False] and not engines.dead
    # restarted by the supervisor's own poll during the step: not resumed at all
    engines.calls.clear()
    turn(DeviceShare(engines, nothing, supervisor), lambda: supervisor.restart(0))
    assert engines.calls == [("release", [0, 1]), ("resume", [1])] and engines.released == [False, False]


def test_a_failure_the_supervisor_does_not_restart_is_raised():
    engines = Engines()
    engines.released[0] = True  # a live engine that refuses: not a death
    with pytest.raises(RuntimeError, match="engine 0 failed in 'release_memory': 400"):
        turn(DeviceShare(engines, nothing, Supervisor(engines)))
    engines = Engines()
    engines.dead.add(0)  # fault.tolerate_engines = false: the first failure stops the step
    supervisor = Supervisor(engines, restarts=False)
    with pytest.raises(RuntimeError, match="Connection refused"):
        turn(DeviceShare(engines, nothing, supervisor))
    assert supervisor.checks == 0


@pytest.mark.parametrize("takes_engine_cores", [True, False])
def test_an_evaluation_on_the_engines_ends_before_the_trainer_takes_their_cores(takes_engine_cores):
    """Disaggregated on CPU under the sync schedule, each side has every core in turn: the trainer's turn waits for
    an evaluation on the engines; where the sides have cores of their own it does not."""
    settled = []

    async def settle():
        settled.append(True)

    async def main():
        share = DeviceShare(None, settle, takes_engine_cores=takes_engine_cores)
        async with share.trainer_turn():
            return list(settled)

    assert asyncio.run(main()) == ([True] if takes_engine_cores else [])
