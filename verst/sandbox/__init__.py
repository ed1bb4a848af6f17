"""Sandboxes for agent tool calls: a provider protocol and a local provider isolated with bubblewrap."""

from verst.sandbox.base import ExecResult, Lifetime, Sandbox, SandboxError, SandboxProvider
from verst.sandbox.lifetime import SandboxScopes
from verst.sandbox.local import BubblewrapProvider, BubblewrapSandbox, SandboxLimits

__all__ = ["BubblewrapProvider", "BubblewrapSandbox", "ExecResult", "Lifetime", "Sandbox", "SandboxError",
           "SandboxLimits", "SandboxProvider", "SandboxScopes"]
