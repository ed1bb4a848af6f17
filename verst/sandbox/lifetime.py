"""Which sandbox a trajectory uses, by lifetime: its own, its group's, or one for the whole run.

`SandboxScopes.get(group, trajectory)` starts a sandbox on first use under the lifetime's key; `end_trajectory`,
`end_group` and `close` close the sandboxes whose lifetime ends there, so none outlives its scope.
"""

from collections.abc import Hashable

from verst.sandbox.base import Lifetime, Sandbox, SandboxProvider


class SandboxScopes:
    def __init__(self, provider: SandboxProvider, lifetime: Lifetime, files: dict[str, str]):
        self.provider, self.lifetime, self.files = provider, Lifetime(lifetime), files
        self.open: dict[Hashable, Sandbox] = {}

    def key(self, group: Hashable, trajectory: Hashable) -> Hashable:
        return {Lifetime.TRAJECTORY: (group, trajectory), Lifetime.GROUP: group, Lifetime.RUN: None}[self.lifetime]

    def get(self, group: Hashable, trajectory: Hashable) -> Sandbox:
        key = self.key(group, trajectory)
        if key not in self.open:
            self.open[key] = self.provider.start(self.files)
        return self.open[key]

    def end_trajectory(self, group: Hashable, trajectory: Hashable) -> None:
        if self.lifetime is Lifetime.TRAJECTORY:
            self.close_key((group, trajectory))

    def end_group(self, group: Hashable) -> None:
        if self.lifetime is Lifetime.GROUP:
            self.close_key(group)

    def close_key(self, key: Hashable) -> None:
        sandbox = self.open.pop(key, None)
        if sandbox is not None:
            sandbox.close()

    def close(self) -> None:
        """Closes every sandbox still open: the run's end."""
        for key in list(self.open):
            self.close_key(key)
