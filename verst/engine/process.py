"""Start and stop engine servers on loopback: as a child process (`EngineProcess`) or as a thread of this
process serving an `EngineCore` already in memory (`BackgroundServer`).

Both bind a free port themselves (the child reports it through a file), so two engines never race for
one. Stopping is bounded (SIGTERM, then SIGKILL); context managers stop them even on errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from verst.inference_client.ports import wait_healthy


class EngineProcess:
    """`python -m verst.engine.server` in a child process. `with EngineProcess(model) as e: e.url ...`."""

    def __init__(
        self, model: str | Path, *, host: str = "127.0.0.1", args: list[str] | None = None,
        startup_timeout: float = 120.0, log_path: str | Path | None = None, env: dict[str, str] | None = None,
        entry: list[str] | None = None, port: int = 0,
    ):
        self.model, self.host, self.args = str(model), host, list(args or [])
        self.requested_port = port  # 0: the OS picks; a restarted engine asks for its old port again
        # how to run the server: this module by default; `["-m", "verst.cli.main", "serve", "engine"]` works too
        self.entry = list(entry or ["-m", "verst.engine.server"])
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._started = 0.0

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("engine process not started")
        return f"http://{self.host}:{self.port}"

    def start(self, wait: bool = True) -> EngineProcess:
        """Launch the child; with `wait`, return once it is healthy (else call `wait_ready()`)."""
        self._tmp = tempfile.TemporaryDirectory(prefix="verst-engine-")
        port_file = Path(self._tmp.name) / "port"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(self.env or {})}
        cmd = [sys.executable, *self.entry, "--model", self.model, "--host", self.host,
               "--port", str(self.requested_port), "--port-file", str(port_file), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if log is not subprocess.DEVNULL:
            log.close()
        self._started = time.monotonic()
        return self.wait_ready() if wait else self

    def wait_ready(self) -> EngineProcess:
        if self.proc is None or self._tmp is None:
            raise RuntimeError("engine process not started")
        port_file = Path(self._tmp.name) / "port"
        try:
            deadline = self._started + self.startup_timeout
            while not port_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"engine for {self.model} exited with code {self.proc.returncode} at start-up"
                                       + (f"; see {self.log_path}" if self.log_path else ""))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine for {self.model} did not bind a port in {self.startup_timeout:g}s")
                time.sleep(0.05)
            self.port = int(port_file.read_text())
            wait_healthy(self.url, max(deadline - time.monotonic(), 1.0), self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class BackgroundServer:
    """The HTTP server of an in-memory `EngineCore`, run by uvicorn in a daemon thread on loopback."""

    def __init__(self, core: Any, *, host: str = "127.0.0.1", served_model_name: str = "model", model_path: str = ""):
        self.core, self.host = core, host
        self.served_model_name, self.model_path = served_model_name, model_path
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        import uvicorn

        from verst.engine.app import uvicorn_config
        from verst.engine.runner import EngineRunner
        from verst.engine.server import create_app, listening_socket
        from verst.engine.service import ServerState

        sock = listening_socket(self.host, 0)
        self.port = sock.getsockname()[1]
        state = ServerState(runner=EngineRunner(self.core), tokenizer=self.core.tokenizer, model_path=self.model_path,
                            served_model_name=self.served_model_name, host=self.host, port=self.port)
        self._server = uvicorn.Server(uvicorn_config(create_app(state)))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"verst-engine-http-{self.port}")
        self._thread.start()
        try:
            wait_healthy(self.url, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._server, self._thread = None, None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
