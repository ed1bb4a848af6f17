"""A run's sandboxes by lifetime: each trajectory its own, one per group, one per run; a shared sandbox gives each
trajectory a directory of its own, started once however many ask at once, closed when its scope ends."""

import asyncio
import threading
import time

import pytest

from verst.sandbox import BubblewrapProvider, ExecResult, SandboxError, SandboxPool, Workspace


class FakeSandbox:
    def __init__(self, files):
        self.files, self.commands, self.closed = dict(files), [], False

    def exec(self, command, timeout_s):
        assert not self.closed
        self.commands.append(command)
        return ExecResult(0, "")

    def read_file(self, path):
        return self.files[path]

    def write_file(self, path, text):
        assert not self.closed
        self.files[path] = text

    def close(self):
        self.closed = True


class FakeProvider:
    """Starts fake sandboxes, each start taking `start_s` in the calling thread."""

    def __init__(self, start_s=0.0):
        self.started, self.start_s, self.lock = [], start_s, threading.Lock()

    def start(self, files):
        time.sleep(self.start_s)
        with self.lock:
            self.started.append(FakeSandbox(files))
            return self.started[-1]


async def one_group(pool, group, files, size=2):
    """The group's trajectories acquire at once, then each releases; returns what each was given."""
    given = await asyncio.gather(*(pool.acquire(group, t, files) for t in range(size)))
    for t, sandbox in enumerate(given):
        await pool.release(group, t, sandbox)
    return given


def test_each_trajectory_gets_a_sandbox_of_its_own_closed_at_release():
    provider = FakeProvider()
    pool = SandboxPool(provider, "trajectory", group_size=2)

    async def main():
        given = [*await one_group(pool, 0, {"a.py": "x"}), *await one_group(pool, 1, {"a.py": "y"})]
        assert [box.files for box in given] == [{"a.py": "x"}] * 2 + [{"a.py": "y"}] * 2
        assert all(box.closed for box in given) and pool.open_sandboxes() == []

    asyncio.run(main())
    assert len(provider.started) == 4


def test_a_group_shares_one_sandbox_started_once_each_trajectory_in_its_own_directory():
    provider = FakeProvider(start_s=0.05)  # both trajectories ask while the start is under way
    pool = SandboxPool(provider, "group", group_size=2)

    async def main():
        first = await one_group(pool, 7, {"a.py": "x"})
        assert len(provider.started) == 1 and provider.started[0].closed  # both released: the group's end
        assert [w.directory for w in first] == ["trajectories/7-0", "trajectories/7-1"]
        assert provider.started[0].files == {"trajectories/7-0/a.py": "x", "trajectories/7-1/a.py": "x"}
        await one_group(pool, 8, {"a.py": "y"})
        assert len(provider.started) == 2 and provider.started[1].closed

    asyncio.run(main())


def test_a_group_sandbox_stays_open_while_a_trajectory_still_uses_it():
    provider = FakeProvider()
    pool = SandboxPool(provider, "group", group_size=2)

    async def main():
        # a retried trajectory: three acquires, the group's two releases come while the third still works
        boxes = [await pool.acquire(0, t, {}) for t in (0, 1, 1)]
        await pool.release(0, 0, boxes[0])
        await pool.release(0, 1, boxes[1])
        assert not provider.started[0].closed
        await pool.release(0, 1, boxes[2])
        assert provider.started[0].closed

    asyncio.run(main())


def test_the_run_shares_one_sandbox_closed_at_the_end_and_a_closed_one_is_replaced():
    provider = FakeProvider()
    pool = SandboxPool(provider, "run", group_size=2)

    async def main():
        await one_group(pool, 0, {"a.py": "x"})
        await one_group(pool, 1, {"a.py": "y"})
        assert len(provider.started) == 1 and not provider.started[0].closed
        # the workspace of each released trajectory is removed
        assert provider.started[0].commands[-1] == "rm -rf trajectories/1-1"
        provider.started[0].close()  # a limit ended it
        await one_group(pool, 2, {})
        assert len(provider.started) == 2
        await pool.aclose()
        assert provider.started[1].closed and pool.open_sandboxes() == []

    asyncio.run(main())


def test_an_unknown_lifetime_is_refused():
    with pytest.raises(ValueError, match="episode"):
        SandboxPool(FakeProvider(), "episode", 1)


def test_workspaces_in_a_shared_local_sandbox_hold_each_trajectorys_own_files():
    pool = SandboxPool(BubblewrapProvider(), "run", group_size=2)

    async def main():
        a = await pool.acquire(0, 0, {"project.py": "A = 1\n"})
        b = await pool.acquire(0, 1, {"project.py": "B = 2\n", "sub/x.txt": "x"})
        assert isinstance(a, Workspace) and a.sandbox is b.sandbox
        assert a.exec("cat project.py; ls", 10).output == "A = 1\nproject.py\n"
        assert b.exec("cat project.py; ls", 10).output == "B = 2\nproject.py\nsub\n"
        a.write_file("project.py", "A = 3\n")
        assert a.read_file("project.py") == "A = 3\n" and b.read_file("project.py") == "B = 2\n"
        for wrong in ("/tmp/workspace/project.py", "../trajectories/0-1/project.py"):
            with pytest.raises(SandboxError, match="relative to the workspace"):
                a.read_file(wrong)
        await pool.release(0, 0, a)
        assert a.sandbox.exec("ls trajectories", 10).output == "0-1\n"  # a's directory is gone
        await pool.release(0, 1, b)
        assert not a.closed  # the run's sandbox lives on
        await pool.aclose()
        assert a.closed and not a.sandbox.workspace.exists()

    asyncio.run(main())


def test_trajectories_sharing_a_local_sandbox_run_commands_at_the_same_time():
    """One trajectory creates and removes files while another runs commands: each exec measures the shared
    workspace's size as files come and go, and none fails for it."""
    pool = SandboxPool(BubblewrapProvider(), "group", group_size=2)

    async def main():
        churn, steady = await asyncio.gather(pool.acquire(0, 0, {}), pool.acquire(0, 1, {}))
        many_files = "mkdir -p d{n}; for i in $(seq 400); do echo x > d{n}/f$i; done; rm -rf d{n}"
        results = await asyncio.gather(
            *(asyncio.to_thread(churn.exec, many_files.format(n=n), 20) for n in range(8)),
            *(asyncio.to_thread(steady.exec, "echo ok", 20) for _ in range(60)))
        assert all(r.exit_code == 0 for r in results)
        await pool.release(0, 0, churn)
        await pool.release(0, 1, steady)
        assert churn.closed

    asyncio.run(main())
