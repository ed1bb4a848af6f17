"""Sandboxes for agent tool calls: a provider protocol, a local provider isolated with bubblewrap, cloud providers
(Daytona, E2B, Modal), their selection by name, and a run's sandboxes by lifetime."""

from verst.sandbox.base import ExecResult, Lifetime, Sandbox, SandboxError, SandboxProvider
from verst.sandbox.lifetime import SandboxPool, Workspace
from verst.sandbox.local import BubblewrapProvider, BubblewrapSandbox, SandboxLimits
from verst.sandbox.providers import SANDBOX_PROVIDERS, provider

__all__ = ["SANDBOX_PROVIDERS", "BubblewrapProvider", "BubblewrapSandbox", "ExecResult", "Lifetime", "Sandbox",
           "SandboxError", "SandboxLimits", "SandboxPool", "SandboxProvider", "Workspace", "provider"]
