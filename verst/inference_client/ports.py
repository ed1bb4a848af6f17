"""Port helpers for servers on loopback: a free port, a listening socket bound before the server starts, and
a wait until a server answers its health route. Shared by everything that starts servers (engines, the
gateway, the session server, the router, weight-update groups)."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for servers that cannot bind port 0 themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A bound, listening TCP socket (port 0: the OS picks), so the port is known before the server starts;
    connections made before it accepts wait in the backlog instead of failing.

    TCP_NODELAY (inherited by accepted connections on Linux): without it, Nagle's algorithm and delayed ACKs
    hold every small JSON reply ~40 ms.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, path: str = "/health") -> None:
    """Poll `url + path` until 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(url + path, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} not healthy after {timeout:g}s")
