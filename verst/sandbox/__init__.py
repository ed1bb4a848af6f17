"""Sandboxes for agent tool calls: a provider protocol, a local provider isolated with bubblewrap, cloud providers
(Daytona, E2B, Modal) and their selection by name."""

from verst.sandbox.base import ExecResult, Lifetime, Sandbox, SandboxError, SandboxProvider
from verst.sandbox.lifetime import SandboxScopes
from verst.sandbox.local import BubblewrapProvider, BubblewrapSandbox, SandboxLimits
from verst.sandbox.providers import SANDBOX_PROVIDERS, provider

__all__ = ["SANDBOX_PROVIDERS", "BubblewrapProvider", "BubblewrapSandbox", "ExecResult", "Lifetime", "Sandbox",
           "SandboxError", "SandboxLimits", "SandboxProvider", "SandboxScopes", "provider"]
