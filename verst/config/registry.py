"""A registry: the names one config field accepts, each with what it stands for, in one table.

An entry's `target` is the object itself or its import path (`package.module:name`), imported at first use,
so the config can check a name (and read an entry's traits) without importing torch. Users add names with
`register` in a module that `plugins` lists; the config then accepts them, and every process of the run
imports that module before it looks a name up.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from verst.config.imports import load_object


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered name: `target` (an object, or its import path) and one line for `verst config docs`."""

    target: Any
    doc: str = ""


E = TypeVar("E", bound=Entry)
T = TypeVar("T")


class Registry(Generic[E]):
    """The names `field` accepts, each an `entry_type` (an `Entry` with the traits callers read)."""

    def __init__(self, field: str, entry_type: type[E] = Entry):  # type: ignore[assignment]
        self.field, self.entry_type = field, entry_type
        self._entries: dict[str, E] = {}
        self._loaded: dict[str, Any] = {}

    def add(self, name: str, entry: E) -> E:
        """Register `entry` under `name`; a name is registered once."""
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.field}: a registered name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.field}: {name!r} is registered already (as {self._entries[name].target!r})")
        self._entries[name] = entry
        return entry

    def register(self, name: str, doc: str = "", **traits: Any) -> Callable[[T], T]:
        """A decorator: `@REGISTRY.register("name", doc="...", trait=...)` over the object it names."""

        def add(target: T) -> T:
            self.add(name, self.entry_type(target=target, doc=doc or _first_line(target), **traits))
            return target

        return add

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> E:
        """The entry of `name`; a name not registered raises `ValueError` naming the field, the value, the
        registered names and the closest one."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(self.unknown(name)) from None

    def load(self, name: str) -> Any:
        """What `name` stands for, imported at first use."""
        if name not in self._loaded:
            target = self.entry(name).target
            self._loaded[name] = load_object(target, self.field) if isinstance(target, str) else target
        return self._loaded[name]

    def check(self, name: str) -> str:
        """`name`, if registered (a config field's validator); else `ValueError` (see `entry`)."""
        self.entry(name)
        return name

    def unknown(self, name: str) -> str:
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (f"{self.field} = {name!r} is not registered; registered: {', '.join(self.names())}{hint} (a name "
                "of your own is registered in a module that `plugins` lists)")


def _first_line(target: Any) -> str:
    doc = getattr(target, "__doc__", None) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""
