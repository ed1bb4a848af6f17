"""What each inference engine (`cluster.engine`) can take — weight transports, LoRA, placement — and its
pass-through flag table (`[vllm]`, `[sglang]`) as a command line; a config asking for more is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

ENGINE_KINDS = ("embedded", "sglang", "vllm")
MEMORY_SAVER = "enable-memory-saver"  # SGLang's flag for releasing GPU memory (`/release_memory_occupation`)


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """`transports`: the `sync.transport` values it takes; `releases_memory`: it gives its device memory to a
    colocated trainer while the trainer steps (SGLang's `/release_memory_occupation`); `owned_flags`: server
    flags verst sets from its own config, refused in the pass-through table."""

    transports: tuple[str, ...]
    lora: bool
    releases_memory: bool
    owned_flags: tuple[str, ...] = ()


CAPABILITIES = {
    "embedded": EngineCapabilities(("distributed", "tensor", "disk"), lora=True, releases_memory=True),
    "vllm": EngineCapabilities(("disk",), lora=False, releases_memory=False,
                               owned_flags=("model", "host", "port", "dtype")),
    "sglang": EngineCapabilities(("distributed", "tensor", "disk"), lora=True, releases_memory=True,
                                 owned_flags=("model-path", "host", "port", "dtype", "weight-version")),
}


def flag_argv(table: str, flags: dict[str, Any]) -> list[str]:
    """A pass-through table (`[vllm]`, `--vllm.<flag> VALUE`) as the server's command line, names unchanged:
    `true` is the bare flag, a list gives one value each; `false` is refused (write the flag's negative
    form, e.g. `no-enable-prefix-caching = true`)."""
    argv: list[str] = []
    for name, value in flags.items():
        if value is False:
            raise ValueError(f"{table}.{name} = false: a pass-through flag is given or not; write its negative "
                             f"form (e.g. {table}.no-{name} = true) or leave it out")
        if value is None or isinstance(value, dict):
            raise ValueError(f"{table}.{name} = {value!r}: a flag value must be a string, number, true or a list")
        argv.append(f"--{name}")
        if value is True:
            continue
        argv += [_flag_value(v) for v in value] if isinstance(value, list) else [_flag_value(value)]
    return argv


def _flag_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def config_problems(engine: str, *, transport: str, lora: bool, model_impl: str, flags: dict[str, dict[str, Any]],
                    placement: str = "disaggregated") -> list[str]:
    """What a config asks of `cluster.engine` that the engine cannot do, each naming the field and value."""
    if engine not in CAPABILITIES:
        return [f"cluster.engine = {engine!r} is not one of {ENGINE_KINDS}"]
    kind = CAPABILITIES[engine]
    problems = []
    if engine == "sglang" and placement == "colocated" and not _flag_given(flags.get("sglang", {}), MEMORY_SAVER):
        problems.append(f"cluster.placement = 'colocated' with cluster.engine = 'sglang' needs sglang.{MEMORY_SAVER} = "
                        "true: verst has SGLang release its GPU memory around each train step, which SGLang does only "
                        "with its memory saver on; or use cluster.placement = 'disaggregated'")
    if transport not in kind.transports:
        why = {"vllm": "vLLM takes new weights from disk here (collective_rpc reload_weights); its weight-transfer "
                       "API broadcasts over NCCL, which its CPU build does not have"}.get(engine, "")
        problems.append(f"sync.transport = {transport!r} is not supported with cluster.engine = {engine!r}"
                        f"{': ' + why if why else ''}; use one of {list(kind.transports)}")
    if engine == "sglang" and lora and not _flag_given(flags.get("sglang", {}), "enable-lora"):
        problems.append("lora.enabled = true with cluster.engine = 'sglang' needs sglang.enable-lora = true (SGLang "
                        "loads adapters only with LoRA enabled at start-up)")
    if lora and not kind.lora:
        problems.append(f"lora.enabled = true is not supported with cluster.engine = {engine!r} (verst does not load "
                        "adapters into it); use cluster.engine = 'embedded' or 'sglang'")
    if engine != "embedded" and model_impl != "auto":
        problems.append(f"model.impl = {model_impl!r} chooses the embedded engine's model class; cluster.engine = "
                        f"{engine!r} runs its own (leave model.impl = 'auto')")
    for table, values in flags.items():
        if values and table != engine:
            problems.append(f"[{table}] flags ({', '.join(values)}) are given, but cluster.engine = {engine!r}; "
                            f"they pass to a {table} server only")
        elif values:
            problems += _flag_problems(kind, table, values)
    return problems


def _flag_given(values: dict[str, Any], name: str) -> bool:
    return any(key.replace("_", "-") == name and value is True for key, value in values.items())


def _flag_problems(kind: EngineCapabilities, table: str, values: dict[str, Any]) -> list[str]:
    problems = []
    for name in values:
        if name.replace("_", "-") in kind.owned_flags:
            problems.append(f"{table}.{name}: verst sets --{name} itself (model.path, model.dtype, a free port on the "
                            "engine's node); leave it out")
    try:
        flag_argv(table, values)
    except ValueError as error:
        problems.append(str(error))
    return problems
