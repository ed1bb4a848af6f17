"""A stand-in Harbor environment, written with harbor's `BaseEnvironment` API, for machines without a
container runtime: each trial gets a host folder standing for the container's root, and harbor's paths
(/app, /logs, /tests, /solution) in commands and uploaded scripts are mapped into it.

It runs the commands harbor and the task give (directory set-up, the verifier's tests/test.sh) with the
host's bash and no isolation, so it is only for trusted tasks and for agents that do not run model-written
commands (examples/harbor/answer_agent.py); real tasks use harbor's own environments (docker, ...).
It runs in Harbor's Python (>= 3.12) environment and imports no verst.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
from pathlib import Path

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.models.trial.paths import EnvironmentPaths

MAPPED = ("/app", "/logs", "/tests", "/solution")
TEXT_SUFFIXES = {".sh", ".py", ".txt", ""}


class LocalEnvironment(BaseEnvironment):
    @staticmethod
    def type() -> str:
        return "verst-local"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities()

    def _validate_definition(self) -> None:
        """Nothing to build: the task's environment/ folder is copied to /app as is."""

    def _host(self, path: str) -> Path:
        return Path(self.map(path))

    def map(self, text: str) -> str:
        """`text` with each harbor path (/app, /logs, ...) moved under this trial's root."""
        pattern = r"(?<![\w./-])(" + "|".join(re.escape(p) for p in MAPPED) + r")(?=/|\b|$)"
        return re.sub(pattern, lambda m: str(self.root) + m.group(1), text)

    async def start(self, force_build: bool) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="harbor-local-"))
        # what a container runtime mounts: the agent's, the verifier's and the artifacts' log folders
        for path in (*MAPPED, EnvironmentPaths.agent_dir, EnvironmentPaths.verifier_dir, EnvironmentPaths.artifacts_dir):
            self._host(str(path)).mkdir(parents=True, exist_ok=True)
        await self.upload_dir(self.environment_dir, "/app")

    async def stop(self, delete: bool) -> None:
        if delete:
            shutil.rmtree(self.root, ignore_errors=True)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = self._host(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source_path, target)
        if target.suffix in TEXT_SUFFIXES:  # scripts name harbor's paths; map them as commands are
            target.write_text(self.map(target.read_text(encoding="utf-8")), encoding="utf-8")

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        for source in Path(source_dir).rglob("*"):
            if source.is_file():
                await self.upload_file(source, f"{target_dir.rstrip('/')}/{source.relative_to(source_dir)}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(self._host(source_path), target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        shutil.copytree(self._host(source_dir), target_dir, dirs_exist_ok=True)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", self.map(command), cwd=self._host(cwd or "/app"),
            env={**os.environ, **(self._merge_env(env) or {})},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return ExecResult(stdout=None, stderr=f"timed out after {timeout_sec} s", return_code=124)
        return ExecResult(stdout=stdout.decode(errors="replace"), stderr=stderr.decode(errors="replace"),
                          return_code=proc.returncode)
