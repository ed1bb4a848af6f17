"""Agent libraries that need another Python than verst's (NeMo Gym and Harbor need >= 3.12) run one episode
per child process of that environment's interpreter: a JSON job on stdin, a JSON result file back."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

STDERR_TAIL = 4000  # characters of a failed child's stderr kept in the error


class ChildError(RuntimeError):
    """The child process failed; the message holds its exit code and the tail of its stderr."""


def interpreter(python: str | os.PathLike | None, env_var: str, default: str, library: str, module: str) -> Path:
    """The interpreter to run: `python`, else $`env_var`, else `default` (relative to the working directory,
    as `make agents` creates it), else verst's own when `module` imports there (`pip install 'verst[...]'`
    on Python >= 3.12); an error naming them all when none exists."""
    if python or os.environ.get(env_var):
        path = Path(python or os.environ[env_var])
    elif Path(default).is_file() or importlib.util.find_spec(module) is None:
        path = Path(default)
    else:
        return Path(sys.executable)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no Python interpreter for the {library} connector; run `make agents` "
                                f"(creates {default}), set {env_var}, or pass python=")
    return path


async def run_child(python: Path, script: Path, job: dict[str, Any], *, pythonpath: list[str],
                    timeout_s: float) -> dict[str, Any]:
    """Run `python -P script RESULT` with `job` as JSON on stdin; the JSON the child wrote to RESULT. (-P: the
    script's folder, verst/connectors, stays off sys.path, where `nemo_gym.py` would shadow the library.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    env.pop("VIRTUAL_ENV", None)
    with tempfile.TemporaryDirectory(prefix="verst-agent-") as tmp:
        result = Path(tmp) / "result.json"
        proc = await asyncio.create_subprocess_exec(
            str(python), "-P", str(script), str(result), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env)
        try:
            _, stderr = await asyncio.wait_for(proc.communicate(json.dumps(job).encode()), timeout_s)
        except BaseException:  # a timeout or a cancelled episode must not leave the child running
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        if proc.returncode != 0 or not result.is_file():
            tail = stderr.decode(errors="replace")[-STDERR_TAIL:]
            raise ChildError(f"{script.name} exited with code {proc.returncode} ({python}):\n{tail}")
        return json.loads(result.read_text(encoding="utf-8"))


def default_pythonpath() -> list[str]:
    """The working directory, where task modules such as `examples.*` resolve, as they do for verst."""
    return [os.getcwd()]
