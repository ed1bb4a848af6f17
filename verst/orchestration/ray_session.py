"""The Ray connection: start a quiet one-node Ray bound to 127.0.0.1, or join an existing cluster.

A session shuts down only a Ray it started itself (joining, it only disconnects), so sessions nest.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray

from verst.orchestration.reaper import Reaper

# The logical resource every CPU bundle asks for: placement groups are exercised (and fail when
# they cannot fit) on machines whose few real cores could not hold one CPU per actor.
SLOT_RESOURCE = "verst_slot"
# Ray on Linux advertises and binds the machine's outward address even for a one-node cluster;
# this switch (read by ray._private.ray_constants) makes it use loopback as it does on macOS.
_LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
_QUIET_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no phoning home from an offline machine
    "RAY_DEDUP_LOGS": "1",
}
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
_RAY_ADDRESS_ENV = "RAY_ADDRESS"
JOIN_PROBE_TIMEOUT_S = 10.0
_UNIX_SOCKET_MAX = 107
# What Ray puts under its temp dir before a socket's name: /session_<date>_<time>_<micros>_<pid>/sockets/plasma_store
_RAY_SOCKET_TAIL = len("/session_2026-12-04_15-06-44_233281_4194304/sockets/plasma_store")
# Announces at every start that token authentication is on (Ray's default, which we keep).
_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
logger = logging.getLogger(__name__)


class RaySession:
    """`with RaySession(slots=4) as ray_session: ...`; `address` joins a cluster instead of starting one.

    A local Ray declares `slots` units of `SLOT_RESOURCE` and at least `num_cpus` logical CPUs (default:
    the machine's cores). If Ray is already initialised in this process, that connection is reused and
    left running on exit.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        slots: int = 0,
        num_cpus: float | None = None,
        num_gpus: int | None = None,
        namespace: str = "verst",
        object_store_bytes: int | None = None,
        log_to_driver: bool = True,
    ):
        if slots < 0:
            raise ValueError(f"RaySession: slots must be >= 0, got {slots}")
        self.address, self.slots, self.namespace = address, slots, namespace
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.object_store_bytes, self.log_to_driver = object_store_bytes, log_to_driver
        self.owned = False  # this session called ray.init and will call ray.shutdown
        self.tmp_dir: Path | None = None  # a local Ray's temporary files and its processes' (TMPDIR)
        self._reaper: Reaper | None = None
        self._saved_env: dict[str, str | None] = {}

    def start(self) -> RaySession:
        if ray.is_initialized():
            return self
        if self.address is not None:
            self._join()
        else:
            self._start_local()
        self.owned = True
        return self

    def _join(self) -> None:
        """Connect to the cluster at `address` as a driver: no local Ray, no reaper (the cluster's own
        raylets end this job's actors when the driver disconnects)."""
        host, port = split_address(self.address)
        if port is not None:  # Ray retries an unanswered address for minutes: fail fast, by name
            check_reachable(host, port)
        if host in _LOOPBACK_HOSTS:
            # A cluster started on loopback (`ray start --head --node-ip-address 127.0.0.1`): without the
            # switch, Ray on Linux rewrites the address to the machine's outward one, where nothing listens.
            self._use_loopback()
        kept = _SigtermKept()
        try:
            ray.init(address=self.address, namespace=self.namespace, logging_level=logging.WARNING,
                     log_to_driver=self.log_to_driver)
        except BaseException:
            self._restore_env()
            raise
        finally:
            kept.restore()

    def _start_local(self) -> None:
        """A new one-node Ray of this run's own. `address="local"` is what makes it new: without it
        `ray.init` joins whatever `RAY_ADDRESS` or the machine's last `ray start` (Ray's
        `ray_current_cluster` file) names, which may be another user's cluster or a dead address."""
        stray = os.environ.get(_RAY_ADDRESS_ENV)
        if stray:
            logger.warning("%s=%s is set and ignored: verst starts a Ray of its own unless "
                           "cluster.ray_address names the cluster to join", _RAY_ADDRESS_ENV, stray)
        self._set_env(_QUIET_ENV)
        self._use_loopback()
        self._start_reaper()
        self._put_cwd_on_pythonpath()
        cores = os.cpu_count() or 1
        num_cpus = max(cores, math.ceil(self.num_cpus or 0))
        notice = logging.getLogger(_AUTH_NOTICE_LOGGER)
        level = notice.level
        notice.setLevel(logging.ERROR)
        kept = _SigtermKept()
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                num_gpus=self.num_gpus,
                resources={SLOT_RESOURCE: float(self.slots)} if self.slots else None,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                namespace=self.namespace,
                object_store_memory=self.object_store_bytes,
                logging_level=logging.WARNING,
                log_to_driver=self.log_to_driver,
                _temp_dir=str(self.tmp_dir),
            )
        except BaseException:
            ray.shutdown()  # whatever part of Ray did start
            self._stop_reaper()
            self._restore_env()
            raise
        finally:
            notice.setLevel(level)
            kept.restore()

    def shutdown(self) -> None:
        """Shut Ray down if this session started it (every actor and placement group goes with it); a joined
        cluster is only disconnected from: the run's actors end with its job, the nodes keep running."""
        if not self.owned:
            return
        self.owned = False
        ray.shutdown()
        self._stop_reaper()
        self._restore_env()

    def watch_run(self, run_dir: Path | None) -> None:
        """Name the run in progress (None: none) to the reaper, which writes its summary.json and report.html
        if this driver is killed. Without a reaper (a joined cluster, a Ray started before) nothing is told."""
        if self._reaper is not None:
            self._reaper.watch_run(run_dir)

    def resources(self) -> dict[str, float]:
        """The cluster's total logical resources."""
        return dict(ray.cluster_resources())

    def __enter__(self) -> RaySession:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- what a killed driver leaves behind: nothing ---------------------------------------
    def _start_reaper(self) -> None:
        """A run-owned temporary directory, for Ray's session files and, through TMPDIR (which Ray's
        processes inherit), every temporary path of the run's processes; and the reaper that ends those
        processes and removes it when this driver dies. A short path: Ray's sockets live under it."""
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="verst-", dir=socket_safe_temp_root()))
        self._saved_env.setdefault("TMPDIR", os.environ.get("TMPDIR"))
        os.environ["TMPDIR"] = str(self.tmp_dir)
        self._reaper = Reaper.start(self.tmp_dir)

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.done()
            self._reaper = None
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    # ---- environment -------------------------------------------------------------------
    def _use_loopback(self) -> None:
        self._set_env({_LOOPBACK_SWITCH: "0"})
        import ray._private.ray_constants as constants

        # The switch is read at `import ray`, which may have happened before this call.
        self._saved_loopback = constants.ENABLE_RAY_CLUSTER
        constants.ENABLE_RAY_CLUSTER = False

    def _set_env(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            if key in os.environ:
                continue  # the user's own setting wins
            self._saved_env[key] = None
            os.environ[key] = value

    def _put_cwd_on_pythonpath(self) -> None:
        """Plug-ins named by import path (`rollout.agent_fn = "examples.calc:run"`) must import in the
        actors as they do in the driver, whose cwd Python searches first; Ray's workers start elsewhere."""
        old = os.environ.get("PYTHONPATH")
        if old is not None and os.getcwd() in old.split(os.pathsep):
            return
        self._saved_env["PYTHONPATH"] = old
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), old]))

    def _restore_env(self) -> None:
        for key, old in self._saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        self._saved_env = {}
        if hasattr(self, "_saved_loopback"):
            import ray._private.ray_constants as constants

            constants.ENABLE_RAY_CLUSTER = self._saved_loopback
            del self._saved_loopback


class _SigtermKept:
    """The driver's SIGTERM handler across `ray.init`, whose core worker installs one of its own that prints a
    C++ stack and aborts the driver (exit -6, no cleanup): the one before it (the command line's, which stops
    the run as Ctrl-C does, or Python's default) is put back. Only the main thread can set handlers."""

    def __init__(self) -> None:
        self.main = threading.current_thread() is threading.main_thread()
        self.handler = signal.getsignal(signal.SIGTERM) if self.main else None

    def restore(self) -> None:
        if self.main and self.handler is not None:
            signal.signal(signal.SIGTERM, self.handler)


def socket_safe_temp_root() -> str:
    """Where a run's temporary directory goes: the system's (TMPDIR), unless Ray's sockets under it would
    pass the 107-byte limit of a Unix socket path (a long TMPDIR, or a run started from inside another
    run's), then /tmp."""
    root = tempfile.gettempdir()
    longest = len(root) + len("/verst-xxxxxxxx") + _RAY_SOCKET_TAIL
    return root if longest <= _UNIX_SOCKET_MAX else "/tmp"


def split_address(address: str) -> tuple[str, int | None]:
    """`cluster.ray_address` as (host, port): "host:port", or "auto" (port None)."""
    rest = address.rstrip("/")
    if address == "auto" or ":" not in rest:
        return rest, None
    host, _, port = rest.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"cluster.ray_address = {address!r}: expected HOST:PORT (the head's GCS port) or 'auto'")
    return host.strip("[]"), int(port)


def check_reachable(host: str, port: int, timeout_s: float = JOIN_PROBE_TIMEOUT_S) -> None:
    """Raise `ConnectionError` naming `cluster.ray_address` unless something accepts a connection there."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise ConnectionError(
            f"cluster.ray_address = '{host}:{port}': no Ray head answers there ({error}); start one with "
            f"`ray start --head --port {port}` or leave cluster.ray_address unset for a local Ray") from None
