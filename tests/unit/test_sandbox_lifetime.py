"""Sandbox lifetimes: per trajectory, per group and per run share and close sandboxes as their scope says."""

import pytest

from verst.sandbox import Lifetime
from verst.sandbox.lifetime import SandboxScopes


class FakeSandbox:
    def __init__(self, files):
        self.files, self.closed = dict(files), False

    def close(self):
        self.closed = True


class FakeProvider:
    def __init__(self):
        self.started = []

    def start(self, files):
        self.started.append(FakeSandbox(files))
        return self.started[-1]


@pytest.mark.parametrize("lifetime, distinct", [("trajectory", 4), ("group", 2), ("run", 1)])
def test_sandboxes_are_shared_and_closed_by_lifetime(lifetime, distinct):
    provider = FakeProvider()
    scopes = SandboxScopes(provider, Lifetime(lifetime), {"a.py": "x"})
    for group in ("g0", "g1"):
        boxes = [scopes.get(group, t) for t in (0, 1)]
        assert boxes[0].files == {"a.py": "x"}
        for t, box in enumerate(boxes):
            scopes.end_trajectory(group, t)
            assert box.closed == (lifetime == "trajectory")
        scopes.end_group(group)
        assert all(box.closed for box in boxes) == (lifetime != "run")
    assert len(provider.started) == distinct
    scopes.close()
    assert all(box.closed for box in provider.started) and scopes.open == {}


def test_an_unknown_lifetime_is_refused():
    with pytest.raises(ValueError, match="episode"):
        SandboxScopes(FakeProvider(), "episode", {})
