"""Runs sglang-router (the PyPI package, a child process on loopback) in front of N engines.

`policy="manual", assignment_mode="min_load"` pins a session (header `X-SMG-Routing-Key`) to one engine and
places new sessions on the least-loaded one; a load-based policy (`power_of_two`, `round_robin`, ...) suits
single-turn work. Engines can be added and removed while it runs. Weight updates, pause and abort do not
go through the router: use `fleet()` to reach every engine directly.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet
from verst.inference_client.ports import free_port, wait_healthy

POLICIES = ("manual", "power_of_two", "round_robin", "cache_aware", "random")
ASSIGNMENT_MODES = ("min_load", "min_group", "random")
FILES_PER_REQUEST = 2  # the router holds a request's connection from its caller and the one to its engine
FILES_PER_ENGINE = 4  # health checks and metadata calls to an engine, besides its requests
FILES_RESERVED = 256  # the router's listener, metrics server, log and runtime


def open_files_limit() -> int:
    """This process's limit on open files, its soft limit first raised to the hard one: the router, a child,
    inherits it. `ulimit -n` bounds how many requests one router can hold at once."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard if hard != resource.RLIM_INFINITY else 2**31 - 1


def check_open_files(max_requests: int, engines: int, limit: int) -> None:
    """Refuse a router that would run out of open files holding `max_requests` requests to `engines` engines:
    past the limit its connections fail, and every engine's circuit opens."""
    needed = FILES_PER_REQUEST * max_requests + FILES_PER_ENGINE * engines + FILES_RESERVED
    if needed > limit:
        most = max((limit - FILES_PER_ENGINE * engines - FILES_RESERVED) // FILES_PER_REQUEST, 0)
        raise ValueError(
            f"rollout.concurrency = {max_requests} sends that many requests at once through sglang-router, which "
            f"holds {FILES_PER_REQUEST} connections for each: {needed} open files with {engines} engines, above this "
            f"machine's limit of {limit} (ulimit -n, hard). Set rollout.concurrency to at most {most}, or raise the "
            "limit")


class RouterManager:
    """`with RouterManager([url1, url2]) as router: EngineClient(router.url, affinity=True) ...`."""

    def __init__(
        self, engine_urls: list[str] | None = None, *, policy: str = "manual", assignment_mode: str = "min_load",
        host: str = "127.0.0.1", port: int | None = None, retries: bool = False, startup_timeout: float = 30.0,
        log_path: str | Path | None = None, extra_args: list[str] | None = None, max_requests: int | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} unknown; choices: {', '.join(POLICIES)}")
        if assignment_mode not in ASSIGNMENT_MODES:
            choices = ", ".join(ASSIGNMENT_MODES)
            raise ValueError(f"router assignment_mode {assignment_mode!r} unknown; choices: {choices}")
        self.policy, self.assignment_mode = policy, assignment_mode
        self.host, self.requested_port = host, port
        # Router retries would re-send a generation to another engine; callers decide instead.
        self.retries = retries
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = list(extra_args or [])
        self.engine_urls = [u.rstrip("/") for u in engine_urls or []]
        self.max_requests = max_requests  # the most requests its callers send at once (checked against ulimit -n)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("router not started")
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> RouterManager:
        limit = open_files_limit()
        if self.max_requests is not None:
            check_open_files(self.max_requests, len(self.engine_urls), limit)
        attempts = 1 if self.requested_port else 3  # a free port can be taken between probe and bind
        for attempt in range(attempts):
            try:
                self._launch(self.requested_port or free_port(self.host))
                self._wait_for_workers(self.engine_urls, present=True)
                return self
            except BaseException:
                self.stop()
                if attempt == attempts - 1:
                    raise
        return self

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> RouterManager:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- engines ---------------------------------------------------------------------------------------
    def workers(self) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/workers", timeout=10.0)
        response.raise_for_status()
        return list(response.json().get("workers", []))

    def add_engine(self, url: str, timeout: float = 30.0) -> None:
        url = url.rstrip("/")
        response = httpx.post(f"{self.url}/workers", json={"url": url}, timeout=10.0)
        if response.status_code >= 400:
            raise RuntimeError(f"router refused engine {url}: {response.status_code} {response.text[:300]}")
        self.engine_urls.append(url)
        self._wait_for_workers([url], present=True, timeout=timeout)

    def remove_engine(self, url: str, timeout: float = 30.0) -> None:
        url = url.rstrip("/")
        ids = [w["id"] for w in self.workers() if w.get("url", "").rstrip("/") == url]
        if not ids:
            raise KeyError(f"engine {url} is not behind the router (workers: {self._worker_urls()})")
        for worker_id in ids:
            response = httpx.delete(f"{self.url}/workers/{worker_id}", timeout=10.0)
            if response.status_code >= 400:
                raise RuntimeError(f"router refused to remove {url}: {response.status_code} {response.text[:300]}")
        self.engine_urls = [u for u in self.engine_urls if u != url]
        self._wait_for_workers([url], present=False, timeout=timeout)

    def fleet(self, timeouts: Timeouts | None = None) -> EngineFleet:
        """Direct clients of the current engines, for weight updates, pause and abort."""
        return EngineFleet(list(self.engine_urls), timeouts=timeouts)

    # ---- internals -------------------------------------------------------------------------------------
    def _launch(self, port: int) -> None:
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(port),
               "--policy", self.policy, "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
               "--log-level", "warn", "--worker-startup-timeout-secs", str(int(self.startup_timeout))]
        if self.policy == "manual":
            cmd += ["--assignment-mode", self.assignment_mode]
        if self.engine_urls:
            cmd += ["--worker-urls", *self.engine_urls]
        if not self.retries:
            cmd.append("--disable-retries")
        cmd += self.extra_args
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        if log is not subprocess.DEVNULL:
            log.close()
        self.port = port
        wait_healthy(self.url, self.startup_timeout, self.proc, path="/workers")

    def _worker_urls(self) -> list[str]:
        return [w.get("url", "").rstrip("/") for w in self.workers()]

    def _wait_for_workers(self, urls: list[str], present: bool, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while True:
            listed = {w.get("url", "").rstrip("/"): w for w in self.workers()}
            if present and all(u in listed and listed[u].get("is_healthy", True) for u in urls):
                return
            if not present and not any(u in listed for u in urls):
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                state = "registered and healthy" if present else "removed"
                waited = timeout or self.startup_timeout
                raise TimeoutError(f"engines {urls} not {state} in the router after {waited:g}s "
                                   f"(workers: {sorted(listed)})")
            time.sleep(0.1)
