"""Extension points are import paths: `package.module:attr` or `package.module.attr`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class ImportPathError(ValueError):
    """An import path named in the config does not resolve; the message names the field and path."""


def load_object(path: str, field: str = "import path") -> Any:
    """Import and return the object at `path`; `field` names the config field in errors."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportPathError(f"{field} = {path!r} is not of the form 'package.module:name' or 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportPathError(f"{field} = {path!r}: cannot import module {module_name!r} ({e})") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportPathError(f"{field} = {path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a module path) on first use, so importing
    the package stays cheap (no torch, no Ray) for callers that touch only its light parts."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__


def import_plugins(modules: list[str]) -> None:
    """Import every module `plugins` lists (each once per process): they register names of their own."""
    if not isinstance(modules, list | tuple):
        raise ImportPathError(f"plugins = {modules!r}: expected a list of module names")
    for index, module in enumerate(modules):
        if not isinstance(module, str) or not module:
            raise ImportPathError(f"plugins[{index}] = {module!r}: expected a module name ('package.module')")
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportPathError(f"plugins[{index}] = {module!r}: cannot import it ({error})") from None
