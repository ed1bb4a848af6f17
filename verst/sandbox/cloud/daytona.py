"""Daytona sandboxes through the `daytona` SDK: created from a snapshot (or an image with CPU, memory and disk),
ephemeral (deleted once stopped) with a time to live, so none outlives its run even if close() is never called.
"""

import math
from dataclasses import dataclass

from verst.sandbox.base import ExecResult, SandboxError
from verst.sandbox.cloud import CloudOptions, OutputSink, credential, sdk, service_call, shell_line

PROVIDER = "daytona"


@dataclass(frozen=True)
class DaytonaOptions(CloudOptions):
    """What a Daytona sandbox runs on; `image` builds one with the resources below, else `snapshot` is used."""

    snapshot: str | None = None  # a snapshot name; None: the organization's default snapshot
    image: str | None = None  # a container image (e.g. "python:3.12-slim"), used instead of a snapshot
    cpu: int | None = None  # cores, with `image` only (a snapshot fixes its own)
    memory_gib: int | None = None  # with `image` only
    disk_gib: int | None = None  # with `image` only
    idle_minutes: int = 15  # stopped (and so deleted) after this long without activity
    target: str | None = None  # the region; None: DAYTONA_TARGET or the organization's default
    start_timeout_s: float = 120  # how long create waits for the sandbox to start


class DaytonaProvider:
    """Starts Daytona sandboxes; the credential is `api_key` or DAYTONA_API_KEY, the endpoint `api_url` or
    DAYTONA_API_URL (Daytona's cloud by default)."""

    def __init__(self, options: DaytonaOptions = DaytonaOptions(), api_key: str | None = None,
                 api_url: str | None = None):
        self.daytona_sdk = sdk("daytona", PROVIDER, PROVIDER)
        if options.image is not None and options.snapshot is not None:
            raise SandboxError(f"daytona: a sandbox starts from an image ({options.image}) or a snapshot "
                               f"({options.snapshot}), not both")
        if options.image is None and any(v is not None for v in (options.cpu, options.memory_gib, options.disk_gib)):
            raise SandboxError("daytona: cpu, memory_gib and disk_gib apply to a sandbox built from an image; a "
                               f"snapshot ({options.snapshot or 'the default'}) fixes its own resources")
        self.options = options
        config = self.daytona_sdk.DaytonaConfig(api_key=credential(api_key, "DAYTONA_API_KEY", PROVIDER),
                                                api_url=api_url, target=options.target)
        with service_call(PROVIDER, "client set-up", (self.daytona_sdk.DaytonaError,)):
            self.client = self.daytona_sdk.Daytona(config)

    def create_params(self):
        options, daytona = self.options, self.daytona_sdk
        common = dict(labels={"created-by": "verst"}, network_block_all=not options.network, ephemeral=True,
                      auto_stop_interval=options.idle_minutes, ttl_minutes=math.ceil(options.lifetime_s / 60))
        if options.image is not None:
            resources = daytona.Resources(cpu=options.cpu, memory=options.memory_gib, disk=options.disk_gib)
            return daytona.CreateSandboxFromImageParams(image=options.image, resources=resources, **common)
        return daytona.CreateSandboxFromSnapshotParams(snapshot=options.snapshot, **common)

    def start(self, files: dict[str, str]) -> "DaytonaSandbox":
        with service_call(PROVIDER, "create", (self.daytona_sdk.DaytonaError,)):
            remote = self.client.create(self.create_params(), timeout=self.options.start_timeout_s)
        sandbox = DaytonaSandbox(remote, self.options, self.daytona_sdk)
        try:
            with service_call(PROVIDER, f"upload to sandbox {remote.id}", (self.daytona_sdk.DaytonaError,)):
                remote.fs.create_folder(self.options.workspace, "755")
                uploads = [self.daytona_sdk.FileUpload(source=text.encode(), destination=self.options.remote_path(path))
                           for path, text in files.items()]
                if uploads:
                    remote.fs.upload_files(uploads)
        except BaseException:
            sandbox.close()
            raise
        return sandbox


class DaytonaSandbox:
    def __init__(self, remote, options: DaytonaOptions, daytona_sdk):
        self.remote, self.options, self.daytona_sdk = remote, options, daytona_sdk
        self.errors = (daytona_sdk.DaytonaError,)
        self.closed = False

    def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.check_open()
        sink = OutputSink(self.options.output_bytes)
        with service_call(PROVIDER, f"exec in sandbox {self.remote.id}", self.errors):
            try:
                reply = self.remote.process.exec(shell_line(command), cwd=self.options.workspace,
                                                 timeout=max(1, math.ceil(timeout_s)))
            except self.daytona_sdk.DaytonaTimeoutError:
                # The toolbox ends a command past its timeout and answers 408; what it printed is not returned.
                return sink.result(0, timed_out=True)
        sink.add(reply.result or "")
        return sink.result(reply.exit_code)

    def read_file(self, path: str) -> str:
        self.check_open()
        with service_call(PROVIDER, f"read {path} from sandbox {self.remote.id}", self.errors):
            return self.remote.fs.download_file(self.options.remote_path(path)).decode()

    def write_file(self, path: str, text: str) -> None:
        self.check_open()
        with service_call(PROVIDER, f"write {path} in sandbox {self.remote.id}", self.errors):
            self.remote.fs.upload_file(text.encode(), self.options.remote_path(path))

    def check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"daytona sandbox {self.remote.id} is closed")

    def close(self) -> None:
        """Deletes the sandbox; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        with service_call(PROVIDER, f"delete of sandbox {self.remote.id}", self.errors):
            self.remote.delete()
