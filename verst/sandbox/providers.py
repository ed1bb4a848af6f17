"""The sandbox providers by name, so a recipe chooses one (`sandbox.provider`); in code,
`provider("e2b", options=E2BOptions(...))`.

The names live in `verst.config.registries.SANDBOX_PROVIDERS`, each standing for an import path imported when
chosen, so a cloud SDK loads only for the provider that uses it. Register a provider of your own (or one of these
built with options of yours) under a new name in a module that `plugins` lists.
"""

from typing import Any

from verst.config.registries import SANDBOX_PROVIDERS
from verst.sandbox.base import SandboxProvider

__all__ = ["SANDBOX_PROVIDERS", "provider"]


def provider(name: str, **options: Any) -> SandboxProvider:
    """The provider registered as `name`, built with `options` (its constructor's arguments); an unknown name is
    a `ValueError` listing the registered ones."""
    return SANDBOX_PROVIDERS.load(name)(**options)
