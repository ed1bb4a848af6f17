"""Recipe files (TOML or YAML) plus dotted command-line overrides → a validated `VerstConfig`.

Errors name the field (in dotted form), the value given and what was expected.
"""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from verst.config.schema import VerstConfig

# Tables of an engine's own flags: their keys are the server's flag names, kept as written (dashes too).
PASS_THROUGH_TABLES = ("vllm", "sglang")


class ConfigError(ValueError):
    """A config could not be built; the message names every offending field and value."""


def load_config(
    recipe: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> VerstConfig:
    """Build the config: schema defaults ← `base` ← recipe file ← `--a.b value` overrides."""
    tree: dict[str, Any] = {}
    if base:
        _merge(tree, base)
    if recipe is not None:
        _merge(tree, read_recipe(recipe))
    for dotted, value in parse_overrides(overrides or []):
        _set_dotted(tree, dotted, value)
    return validate_tree(tree)


def validate_tree(tree: dict[str, Any]) -> VerstConfig:
    _check_unknown_keys(tree, VerstConfig, prefix="")
    _check_booleans(tree, VerstConfig, prefix="")
    try:
        return VerstConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, tree)) from None


def read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"recipe file {str(path)!r}: extension {path.suffix!r} is not .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"recipe file {str(path)!r} does not parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe file {str(path)!r} must hold a table at the top, got {type(data).__name__}")
    return data


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """`['--rollout.batch-size', '16', '--logging.progress=false']` → `[('rollout.batch_size', 16), ...]`.

    Values are read as YAML scalars or flow lists (`16`, `1e-3`, `true`, `[1, 2]`). Only a boolean
    field may stand alone (`--logging.progress` means true); any other field without its value is refused,
    naming the flag, rather than read as `true` (which pydantic would turn into 1).
    """
    out: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected an override like --section.field VALUE, got {arg!r}")
        key, eq, raw = arg[2:].partition("=")
        dotted = _dotted_name(key)
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                raw, i = args[i + 1], i + 1
            else:
                annotation = field_annotation(dotted)
                if annotation is not None and not _accepts_bool(annotation):
                    after = f"; it is followed by {args[i + 1]!r}" if i + 1 < len(args) else ""
                    raise ConfigError(f"--{key} needs a value ({_type_name(annotation)}){after}")
                raw = "true"
        out.append((dotted, _parse_value(raw)))
        i += 1
    return out


def _dotted_name(key: str) -> str:
    """'rollout.batch-size' → 'rollout.batch_size'; a pass-through flag ('vllm.max-num-seqs') stays as written."""
    table, dot, flag = key.partition(".")
    if dot and table.replace("-", "_") in PASS_THROUGH_TABLES:
        return f"{table}.{flag}"
    return key.replace("-", "_")


def field_annotation(dotted: str, model: type[BaseModel] = VerstConfig) -> Any | None:
    """The type annotation of the leaf field `dotted` (e.g. 'rollout.batch_size'); None when the name is
    no leaf field (the unknown-key check names it later, with a suggestion)."""
    *sections, leaf = dotted.split(".")
    for name in sections:
        info = model.model_fields.get(name)
        model = _section_model(info.annotation) if info is not None else None
        if model is None:
            return None
    info = model.model_fields.get(leaf)
    if info is None or _section_model(info.annotation) is not None:
        return None
    return info.annotation


def _accepts_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    return any(_accepts_bool(arg) for arg in typing.get_args(annotation) if arg is not type(None))


def _parse_value(raw: str) -> Any:
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    # YAML 1.1 reads '1e-3' as a string; pydantic converts numeric strings for numeric fields.
    return raw if value is None and raw not in ("null", "~", "none", "None") else value


def _merge(dst: dict[str, Any], src: dict[str, Any], top: bool = True) -> None:
    """Deep-merge `src` into `dst`; keys may be spelled with dashes (recipe files, CLI), except inside the
    pass-through tables, whose keys are an engine's flag names."""
    for k, v in src.items():
        k = k.replace("-", "_")
        if top and k in PASS_THROUGH_TABLES and isinstance(v, dict):
            dst[k] = {**(dst[k] if isinstance(dst.get(k), dict) else {}), **v}
        elif isinstance(v, dict):
            if not isinstance(dst.get(k), dict):
                dst[k] = {}
            _merge(dst[k], v, top=False)
        else:
            dst[k] = v


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _check_unknown_keys(tree: dict[str, Any], model: type[BaseModel], prefix: str) -> None:
    """Reject unknown keys with a did-you-mean, before pydantic's less helpful message."""
    fields = model.model_fields
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            known = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config field {name!r} (value {value!r}){hint} Known in this section: {known}")
        sub = _section_model(fields[key].annotation)
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{name}: is a section, expected a table of fields, got {value!r}")
            _check_unknown_keys(value, sub, prefix=f"{name}.")


def _check_booleans(tree: dict[str, Any], model: type[BaseModel], prefix: str) -> None:
    """Refuse true/false for a field that is no boolean: pydantic would read them as 1 and 0."""
    for key, value in tree.items():
        annotation = model.model_fields[key].annotation
        sub = _section_model(annotation)
        if sub is not None:
            _check_booleans(value, sub, prefix=f"{prefix}{key}.")
        elif isinstance(value, bool) and not _accepts_bool(annotation):
            raise ConfigError(f"{prefix}{key}: expected {_type_name(annotation)}, got {value!r}")


def _section_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _format_validation_error(e: ValidationError, tree: dict[str, Any]) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if loc:
            value = _lookup(tree, err["loc"])
            lines.append(f"{loc}: {msg} (got {value!r})")
        else:
            lines.append(msg)
    return "invalid config:\n  " + "\n  ".join(lines)


def _lookup(tree: Any, loc: tuple[Any, ...]) -> Any:
    node = tree
    for p in loc:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return "<default>"
    return node


def iter_fields(model: type[BaseModel] = VerstConfig, prefix: str = ""):
    """Yield (dotted name, type string, default, doc line) for every leaf field, depth first."""
    for name, info in model.model_fields.items():
        sub = _section_model(info.annotation)
        dotted = f"{prefix}{name}"
        if sub is not None:
            yield from iter_fields(sub, prefix=f"{dotted}.")
            continue
        default = info.get_default(call_default_factory=True)
        yield dotted, _type_name(info.annotation), default, info.description or ""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a checked name: the type it checks
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and origin is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "")
