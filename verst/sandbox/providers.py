"""The sandbox providers by name, so a recipe chooses one: `provider("e2b", options=E2BOptions(...))`.

Each name stands for an import path, imported when chosen, so a cloud SDK loads only for the provider that uses it.
"""

from typing import Any

from verst.config.registry import Entry, Registry
from verst.sandbox.base import SandboxProvider

SANDBOX_PROVIDERS: Registry[Entry] = Registry("sandbox provider")
SANDBOX_PROVIDERS.add("local", Entry("verst.sandbox.local:BubblewrapProvider",
                                     "bubblewrap on this machine (extra: sandbox)"))
SANDBOX_PROVIDERS.add("daytona", Entry("verst.sandbox.cloud.daytona:DaytonaProvider",
                                       "Daytona's cloud sandboxes (extra: daytona; DAYTONA_API_KEY)"))
SANDBOX_PROVIDERS.add("e2b", Entry("verst.sandbox.cloud.e2b:E2BProvider",
                                   "E2B's cloud sandboxes (extra: e2b; E2B_API_KEY)"))
SANDBOX_PROVIDERS.add("modal", Entry("verst.sandbox.cloud.modal:ModalProvider",
                                     "Modal's cloud sandboxes (extra: modal; MODAL_TOKEN_ID, MODAL_TOKEN_SECRET)"))


def provider(name: str, **options: Any) -> SandboxProvider:
    """The provider registered as `name`, built with `options` (its constructor's arguments); an unknown name is
    a `ValueError` listing the registered ones."""
    return SANDBOX_PROVIDERS.load(name)(**options)
