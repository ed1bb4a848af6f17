"""Modal sandboxes through the `modal` SDK: a container of an image with CPU and memory, under an app, terminated
by close() or by Modal at its timeout, so none outlives its run even if close() is never called.
"""

import math
import time
from dataclasses import dataclass

from verst.sandbox.base import ExecResult, SandboxError
from verst.sandbox.cloud import CloudOptions, OutputSink, sdk, service_call, shell_argv

PROVIDER = "modal"


@dataclass(frozen=True)
class ModalOptions(CloudOptions):
    """What a Modal sandbox runs on and under which app."""

    image: str | None = None  # a registry image (e.g. "python:3.12-slim"); None: Modal's debian_slim
    cpu: float | None = None  # cores requested; None: Modal's default
    memory_mib: int | None = None  # memory requested; None: Modal's default
    app_name: str = "verst-sandboxes"  # the app the sandboxes run under, created when missing
    idle_timeout_s: int | None = 900  # terminated after this long without activity; None: only `lifetime_s`


class ModalProvider:
    """Starts Modal sandboxes; the credentials are `token_id` and `token_secret`, else MODAL_TOKEN_ID and
    MODAL_TOKEN_SECRET (or the active profile of ~/.modal.toml)."""

    def __init__(self, options: ModalOptions = ModalOptions(), token_id: str | None = None,
                 token_secret: str | None = None):
        self.modal = sdk("modal", PROVIDER, PROVIDER)
        self.options = options
        self.errors = (self.modal.exception.Error,)
        if token_id or token_secret:
            if not (token_id and token_secret):
                raise SandboxError("the modal sandbox provider needs token_id and token_secret together")
            with service_call(PROVIDER, "client set-up", self.errors):
                self.client = self.modal.Client.from_credentials(token_id, token_secret)
        else:
            for key, variable in (("token_id", "MODAL_TOKEN_ID"), ("token_secret", "MODAL_TOKEN_SECRET")):
                if not self.modal.config.config.get(key):
                    raise SandboxError(f"the modal sandbox provider needs a credential: set {variable} (or run "
                                       "`modal token set`) or pass token_id and token_secret")
            self.client = None  # Modal's client from the environment
        self.app = None

    def start(self, files: dict[str, str]) -> "ModalSandbox":
        options, modal = self.options, self.modal
        with service_call(PROVIDER, "create", self.errors):
            if self.app is None:
                self.app = modal.App.lookup(options.app_name, create_if_missing=True, client=self.client)
            image = modal.Image.from_registry(options.image) if options.image else modal.Image.debian_slim()
            remote = modal.Sandbox.create(
                app=self.app, image=image, cpu=options.cpu, memory=options.memory_mib, timeout=options.lifetime_s,
                idle_timeout=options.idle_timeout_s, workdir=options.workspace, block_network=not options.network,
                tags={"created-by": "verst"}, client=self.client)
        sandbox = ModalSandbox(remote, options, self.errors)
        try:
            with service_call(PROVIDER, f"upload to sandbox {remote.object_id}", self.errors):
                remote.filesystem.make_directory(options.workspace)
                for path, text in files.items():
                    remote.filesystem.write_text(text, options.remote_path(path))
        except BaseException:
            sandbox.close()
            raise
        return sandbox


class ModalSandbox:
    def __init__(self, remote, options: ModalOptions, errors: tuple[type[BaseException], ...]):
        self.remote, self.options, self.errors = remote, options, errors
        self.closed = False

    def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.check_open()
        sink = OutputSink(self.options.output_bytes)
        with service_call(PROVIDER, f"exec in sandbox {self.remote.object_id}", self.errors):
            limit_s = max(1, math.ceil(timeout_s))
            started = time.monotonic()
            process = self.remote.exec(*shell_argv(command), workdir=self.options.workspace, timeout=limit_s)
            for chunk in process.stdout:
                sink.add(chunk)
            exit_code = process.wait()
        # The exec timeout ends a command one of two ways, whichever comes first: the SDK's own deadline passing
        # (return code -1), or Modal's worker killing the command, reported as any other signal death (128 + the
        # signal); a signal death once the limit has passed is taken as the timeout.
        killed_at_limit = exit_code > 128 and time.monotonic() - started >= limit_s
        return sink.result(exit_code, timed_out=exit_code == -1 or killed_at_limit)

    def read_file(self, path: str) -> str:
        self.check_open()
        with service_call(PROVIDER, f"read {path} from sandbox {self.remote.object_id}", self.errors):
            return self.remote.filesystem.read_text(self.options.remote_path(path))

    def write_file(self, path: str, text: str) -> None:
        self.check_open()
        with service_call(PROVIDER, f"write {path} in sandbox {self.remote.object_id}", self.errors):
            self.remote.filesystem.write_text(text, self.options.remote_path(path))

    def check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"modal sandbox {self.remote.object_id} is closed")

    def close(self) -> None:
        """Terminates the sandbox; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        with service_call(PROVIDER, f"terminate of sandbox {self.remote.object_id}", self.errors):
            self.remote.terminate()
