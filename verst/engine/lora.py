"""LoRA adapters served by the engine: a PEFT adapter directory read and checked against the model, the
registry of adapters resident by name, and the per-row adapter deltas of one batched forward.

A forward runs the base weights once for every row; each targeted linear then adds
`(x A^T) (scale B)^T` to the rows whose request names that adapter (rows grouped by adapter, gathered
with `index_select` and scattered back with `index_add`), so requests for different adapters and the
base share one step. The directory is read with safetensors and json, not peft: the engine process
imports no transformers for the native forward, and peft would import it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from verst.inference_client.protocol import InvalidRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
# adapter_config.json settings whose arithmetic the engine does not implement, refused by name
_UNSUPPORTED = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
                "fan_in_fan_out": (False, None), "lora_bias": (False, None)}


@dataclasses.dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter. `modules` maps each targeted module of the model to (A [r, in], scale * B [out, r])
    in the model's dtype and device. `version` is unique across loads: a reload under the same name is a
    new adapter, so KV computed under the old one is never taken for the new one (`cache_key`)."""

    name: str
    path: str
    version: int
    rank: int
    alpha: float
    modules: dict[Any, tuple[torch.Tensor, torch.Tensor]]
    module_names: list[str]

    @property
    def cache_key(self) -> str:
        return f"{self.name}@{self.version}"

    def describe(self) -> dict[str, Any]:
        return {"lora_name": self.name, "lora_path": self.path, "version": self.version, "rank": self.rank,
                "lora_alpha": self.alpha, "num_modules": len(self.modules)}


def read_adapter(path: str, name: str, model: Any, version: int) -> LoraAdapter:
    """The PEFT LoRA adapter in directory `path`, checked against `model`; InvalidRequest names the problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidRequest("lora_path", path, "not a directory (a PEFT adapter directory is expected)")
    for needed in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / needed).is_file():
            raise InvalidRequest("lora_path", path, f"no {needed} in the directory (a PEFT LoRA adapter has "
                                 f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise InvalidRequest("lora_path", path, f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    from safetensors.torch import load_file

    return build_adapter(config, load_file(str(folder / WEIGHTS_FILE)), name, model, version, path)


def build_adapter(config: Any, tensors: dict[str, torch.Tensor], name: str, model: Any, version: int,
                  path: str, field: str = "lora_path") -> LoraAdapter:
    """The adapter of a PEFT `config` (adapter_config.json's content) and its tensors under PEFT's names,
    from a directory or pushed by weight sync; refusals name `field` = `path`."""
    _check_config(config, field, path)
    pairs = _pairs(tensors, field, path)
    _check_target_modules(config, model, field, path)
    first = next(model.parameters())
    modules: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
    for module_name, (a, b) in sorted(pairs.items()):
        module = _target(model, module_name, field, path)
        rank, alpha = _pattern(config, "rank_pattern", module_name, config["r"]), _pattern(
            config, "alpha_pattern", module_name, config.get("lora_alpha", 8))
        out_features, in_features = module.weight.shape
        if a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidRequest(field, path, f"rank mismatch: {module_name} has lora_A {list(a.shape)} and "
                                 f"lora_B {list(b.shape)}, {CONFIG_FILE} says r = {rank}")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise InvalidRequest(field, path, f"shape mismatch: {module_name} is [{out_features}, {in_features}] "
                                 f"in the model, the adapter has lora_A {list(a.shape)} and lora_B {list(b.shape)}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        # copied: pushed tensors may be views of a shared-memory file that is deleted after the load
        modules[module] = (a.to(first.device, first.dtype, copy=True).contiguous(),
                           (b.double() * scale).to(first.device, first.dtype).contiguous())
    return LoraAdapter(name, path, version, int(config["r"]), float(config.get("lora_alpha", 8)), modules,
                       sorted(pairs))


def _check_config(config: Any, field: str, path: str) -> None:
    if not isinstance(config, dict):
        raise InvalidRequest(field, path, f"{CONFIG_FILE} must hold a JSON object, not {type(config).__name__}")
    if config.get("peft_type", "LORA") != "LORA":
        raise InvalidRequest(field, path, f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, accepted in _UNSUPPORTED.items():
        if config.get(key) not in accepted:
            raise InvalidRequest(field, path, f"{CONFIG_FILE} sets {key} = {config[key]!r}, which the engine "
                                 f"does not serve (accepted: {', '.join(repr(v) for v in accepted)})")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidRequest(field, path, f"{CONFIG_FILE} has r = {rank!r}; the rank must be an integer >= 1")


def _pairs(tensors: dict[str, torch.Tensor], field: str, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (lora_A, lora_B)} from PEFT's saved keys; any other tensor is refused by name."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or tensor.dim() != 2:
            raise InvalidRequest(field, path, f"{WEIGHTS_FILE} holds {key}, which is not a LoRA A or B matrix "
                                 "of a linear layer (embedding adapters, DoRA and trained biases are not served)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise InvalidRequest(field, path, f"{WEIGHTS_FILE} holds no lora_A / lora_B weights")
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise InvalidRequest(field, path, f"{WEIGHTS_FILE} has no {missing} for {module}")
    return {module: (found["A"], found["B"]) for module, found in parts.items()}


def _target(model: Any, module_name: str, field: str, path: str) -> Any:
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise InvalidRequest(field, path, f"target module {module_name} is not in the model") from None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InvalidRequest(field, path, f"target module {module_name} is not a linear layer")
    return module


def _check_target_modules(config: dict[str, Any], model: Any, field: str, path: str) -> None:
    """Each name of a `target_modules` list must name modules of the model (PEFT matches name suffixes)."""
    targets = config.get("target_modules")
    if not isinstance(targets, list):
        return  # a regex or "all-linear": the saved weights name the modules, checked one by one
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} | {name for name, _ in model.named_modules()}
    absent = sorted(t for t in targets if t not in names and not any(n.endswith(f".{t}") for n in names))
    if absent:
        raise InvalidRequest(field, path, f"target_modules {absent} name no module of the model")


def _pattern(config: dict[str, Any], field: str, module_name: str, default: Any) -> Any:
    """PEFT's per-module rank / alpha override: the first pattern key that matches the module name's end."""
    for key, value in (config.get(field) or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module_name):
            return value
    return default


class LoraRegistry:
    """The adapters resident by name, at most `max_loaded`. Loading under a loaded name replaces it;
    requests hold the adapter they were admitted with, so in-flight ones finish on the old weights."""

    def __init__(self, max_loaded: int):
        self.max_loaded = max_loaded
        self.adapters: dict[str, LoraAdapter] = {}
        self._versions = itertools.count(1)  # next() is atomic: loads are read on HTTP worker threads

    def next_version(self) -> int:
        return next(self._versions)

    def check_room(self, name: str) -> None:
        if name not in self.adapters and len(self.adapters) >= self.max_loaded:
            raise InvalidRequest("lora_name", name, f"{len(self.adapters)} adapters are loaded, the most this engine "
                                 f"holds (max_loaded_loras = {self.max_loaded}); unload one first "
                                 f"(loaded: {sorted(self.adapters)})")

    def add(self, adapter: LoraAdapter) -> LoraAdapter | None:
        """Register `adapter`; returns the one it replaces, if any."""
        self.check_room(adapter.name)
        old = self.adapters.get(adapter.name)
        self.adapters[adapter.name] = adapter
        return old

    def remove(self, name: str) -> LoraAdapter:
        if name not in self.adapters:
            raise self.unknown(name, "lora_name")
        return self.adapters.pop(name)

    def get(self, name: str | None, field: str = "lora_path") -> LoraAdapter | None:
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise self.unknown(name, field)
        return adapter

    def unknown(self, name: str, field: str) -> InvalidRequest:
        loaded = ", ".join(sorted(self.adapters)) or "none"
        return InvalidRequest(field, name, f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}); "
                              "load it with /load_lora_adapter")

    def paths(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self.adapters.items()}


class LoraBatch:
    """The adapter deltas of one forward: rows grouped by the adapter their request names (None: base)."""

    def __init__(self, adapters: list[LoraAdapter | None], device: Any):
        groups: dict[LoraAdapter, list[int]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(adapter, []).append(row)
        self.by_module: dict[Any, list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]] = {}
        for adapter, rows in groups.items():
            # every row on one adapter: no gather or scatter
            index = None if len(rows) == len(adapters) else torch.tensor(rows, device=device)
            for module, (a, b) in adapter.modules.items():
                self.by_module.setdefault(module, []).append((index, a, b))

    @staticmethod
    def of(adapters: list[LoraAdapter | None], device: Any) -> LoraBatch | None:
        return LoraBatch(adapters, device) if any(a is not None for a in adapters) else None

    def modules(self) -> list[Any]:
        return list(self.by_module)

    def linear(self, x: torch.Tensor, module: Any) -> torch.Tensor:
        return self.add_deltas(x, F.linear(x, module.weight, getattr(module, "bias", None)), module)

    def add_deltas(self, x: torch.Tensor, y: torch.Tensor, module: Any) -> torch.Tensor:
        """`y` (the base output of `module` on rows `x`, batch first) plus each adapter's delta on its rows."""
        for rows, a, b in self.by_module.get(module, ()):
            if rows is None:
                y = y + F.linear(F.linear(x, a), b)
            else:
                y = y.index_add(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))
        return y
