"""A run's sandboxes by lifetime (`sandbox.lifetime`): each trajectory its own, one per group, or one per run.

`SandboxPool.acquire(group, trajectory, files)` gives a trajectory a workspace holding its task's files and
`release` ends it. With the `trajectory` lifetime the workspace is a sandbox of its own, started from the files
and closed at release. With `group` or `run` the trajectories share a sandbox, each in a directory of its own
inside it (`Workspace`), removed at release: a group's sandbox closes once the group's trajectories have all
been released and none is using it, the run's at `aclose`. A shared sandbox a limit closed (the local
provider's workspace size) is replaced for the trajectories that come after. The provider's blocking calls
run in threads, off the event loop the session server shares.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
from collections.abc import Hashable
from pathlib import PurePosixPath

from verst.sandbox.base import ExecResult, Lifetime, Sandbox, SandboxError, SandboxProvider

TRAJECTORIES_DIR = "trajectories"  # a shared sandbox's trajectories each work in TRAJECTORIES_DIR/<group>-<index>


class Workspace:
    """A directory of a shared sandbox as one trajectory's sandbox: commands run in it, relative paths resolve
    in it; an absolute path or `..` is refused."""

    def __init__(self, sandbox: Sandbox, directory: str):
        self.sandbox, self.directory = sandbox, directory

    @property
    def closed(self) -> bool:
        return self.sandbox.closed

    def path(self, path: str) -> str:
        relative = PurePosixPath(path)
        if relative.is_absolute() or ".." in relative.parts:
            raise SandboxError(f"path {path!r}: give a path relative to the workspace (it is shared with other "
                               "trajectories at another absolute place)")
        return str(PurePosixPath(self.directory) / relative)

    def exec(self, command: str, timeout_s: float) -> ExecResult:
        return self.sandbox.exec(f"cd {shlex.quote(self.directory)} || exit 125\n{command}", timeout_s)

    def read_file(self, path: str) -> str:
        return self.sandbox.read_file(self.path(path))

    def write_file(self, path: str, text: str) -> None:
        self.sandbox.write_file(self.path(path), text)

    def close(self) -> None:
        """Removes the directory; the shared sandbox lives on."""
        if not self.sandbox.closed:
            self.sandbox.exec(f"rm -rf {shlex.quote(self.directory)}", 30)


@dataclasses.dataclass
class Shared:
    """A sandbox trajectories share: how many use it now and how many have been released from it."""

    sandbox: Sandbox
    users: int = 0
    released: int = 0


class SandboxPool:
    def __init__(self, provider: SandboxProvider, lifetime: Lifetime | str, group_size: int):
        """`group_size`: the trajectories of one group (the `group` lifetime closes a group's sandbox after as
        many releases)."""
        self.provider, self.lifetime, self.group_size = provider, Lifetime(lifetime), group_size
        self.own: dict[tuple[Hashable, Hashable], Sandbox] = {}
        self.shared: dict[Hashable, Shared] = {}
        self.starting: dict[Hashable, asyncio.Task[Shared]] = {}

    async def acquire(self, group: Hashable, trajectory: Hashable, files: dict[str, str]) -> Sandbox:
        if self.lifetime is Lifetime.TRAJECTORY:
            sandbox = self.own[group, trajectory] = await asyncio.to_thread(self.provider.start, files)
            return sandbox
        shared = await self.shared_sandbox(self.shared_key(group))
        shared.users += 1
        workspace = Workspace(shared.sandbox, f"{TRAJECTORIES_DIR}/{group}-{trajectory}")
        try:
            await asyncio.to_thread(seed, workspace, files)
        except BaseException:
            await self.release(group, trajectory, workspace)
            raise
        return workspace

    def shared_key(self, group: Hashable) -> Hashable:
        """What a shared sandbox is kept under: its group's index, or None for the run's one."""
        return group if self.lifetime is Lifetime.GROUP else None

    async def shared_sandbox(self, key: Hashable) -> Shared:
        """The sandbox under `key`, started (once, however many ask at the same time) when there is none or the
        one there was closed."""
        shared = self.shared.get(key)
        if shared is not None and not shared.sandbox.closed:
            return shared
        if key not in self.starting:
            self.starting[key] = asyncio.ensure_future(self.start_shared(key, shared))
        try:
            return await asyncio.shield(self.starting[key])
        finally:
            if key in self.starting and self.starting[key].done():
                del self.starting[key]

    async def start_shared(self, key: Hashable, before: Shared | None) -> Shared:
        sandbox = await asyncio.to_thread(self.provider.start, {})
        # a replaced sandbox's counts carry on: its users release under the same key, and the group ends on time
        shared = self.shared[key] = Shared(sandbox, *((before.users, before.released) if before else (0, 0)))
        return shared

    async def release(self, group: Hashable, trajectory: Hashable, sandbox: Sandbox) -> None:
        """The trajectory is done with `sandbox` (what `acquire` gave it): closed, or its directory removed."""
        if self.lifetime is Lifetime.TRAJECTORY:
            self.own.pop((group, trajectory), None)
            await asyncio.to_thread(sandbox.close)
            return
        key = self.shared_key(group)
        shared = self.shared.get(key)
        try:
            await asyncio.to_thread(sandbox.close)
        finally:
            if shared is not None:
                shared.users -= 1
                shared.released += 1
                if self.lifetime is Lifetime.GROUP and shared.users == 0 and shared.released >= self.group_size:
                    del self.shared[key]
                    await asyncio.to_thread(shared.sandbox.close)

    def open_sandboxes(self) -> list[Sandbox]:
        return [*self.own.values(), *(shared.sandbox for shared in self.shared.values())]

    async def aclose(self) -> None:
        """Closes every sandbox still open: the run's end."""
        for task in self.starting.values():
            task.cancel()
        sandboxes = self.open_sandboxes()
        self.own.clear()
        self.shared.clear()
        errors = []
        for sandbox in sandboxes:
            try:
                await asyncio.to_thread(sandbox.close)
            except Exception as error:  # close the others, then raise the first
                errors.append(error)
        if errors:
            raise errors[0]


def seed(workspace: Workspace, files: dict[str, str]) -> None:
    """The trajectory's directory, emptied and holding `files`."""
    workspace.sandbox.exec(f"rm -rf {shlex.quote(workspace.directory)} && mkdir -p {shlex.quote(workspace.directory)}",
                           30)
    for path, text in files.items():
        workspace.write_file(path, text)
