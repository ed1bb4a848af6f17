"""E2B sandboxes through the `e2b` SDK: a template's microVM, killed by close() or by E2B at its timeout, so none
outlives its run even if close() is never called.
"""

from dataclasses import dataclass

from verst.sandbox.base import ExecResult, SandboxError
from verst.sandbox.cloud import CloudOptions, OutputSink, credential, sdk, service_call, shell_line

PROVIDER = "e2b"


@dataclass(frozen=True)
class E2BOptions(CloudOptions):
    """What an E2B sandbox runs on: a template, which fixes its image, CPU and memory."""

    template: str = "base"  # a template name or id (E2B's `base` has Python and Node)
    request_timeout_s: float = 60  # each API and file request


class E2BProvider:
    """Starts E2B sandboxes; the credential is `api_key` or E2B_API_KEY, the domain `domain` or E2B_DOMAIN."""

    def __init__(self, options: E2BOptions = E2BOptions(), api_key: str | None = None, domain: str | None = None):
        self.e2b = sdk("e2b", PROVIDER, PROVIDER)
        self.options = options
        self.api_key = credential(api_key, "E2B_API_KEY", PROVIDER)
        self.domain = domain
        # Besides its SandboxExceptions the SDK raises, unwrapped, a refused key, a busy service (HTTP 503) and a
        # request that never reached the service: the REST API's over httpx, envd's RPCs over connectrpc.
        transport_errors = (sdk("httpx", PROVIDER, PROVIDER).TransportError,
                            sdk("connectrpc.errors", PROVIDER, PROVIDER).ConnectError)
        self.errors = (self.e2b.SandboxException, self.e2b.AuthenticationException, self.e2b.ServiceBusyException,
                       *transport_errors)

    def start(self, files: dict[str, str]) -> "E2BSandbox":
        options = self.options
        with service_call(PROVIDER, "create", self.errors):
            remote = self.e2b.Sandbox.create(
                template=options.template, timeout=options.lifetime_s, metadata={"created-by": "verst"},
                allow_internet_access=options.network, api_key=self.api_key, domain=self.domain,
                request_timeout=options.request_timeout_s)
        sandbox = E2BSandbox(remote, options, self.e2b, self.errors)
        try:
            with service_call(PROVIDER, f"upload to sandbox {remote.sandbox_id}", self.errors):
                remote.files.make_dir(options.workspace, request_timeout=options.request_timeout_s)
                entries = [{"path": options.remote_path(path), "data": text} for path, text in files.items()]
                if entries:
                    remote.files.write_files(entries, request_timeout=options.request_timeout_s)
        except BaseException:
            sandbox.close()
            raise
        return sandbox


class E2BSandbox:
    def __init__(self, remote, options: E2BOptions, e2b, errors: tuple[type[BaseException], ...]):
        self.remote, self.options, self.e2b, self.errors = remote, options, e2b, errors
        self.closed = False

    def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.check_open()
        sink = OutputSink(self.options.output_bytes)
        with service_call(PROVIDER, f"exec in sandbox {self.remote.sandbox_id}", self.errors):
            try:
                reply = self.remote.commands.run(shell_line(command), cwd=self.options.workspace, timeout=timeout_s,
                                                 on_stdout=sink.add, on_stderr=sink.add,
                                                 request_timeout=self.options.request_timeout_s)
            except self.e2b.CommandExitException as failed:
                return sink.result(failed.exit_code)
            except self.e2b.TimeoutException:
                # E2B ends the command's stream at `timeout`; the output streamed until then is kept.
                return sink.result(0, timed_out=True)
        return sink.result(reply.exit_code)

    def read_file(self, path: str) -> str:
        self.check_open()
        with service_call(PROVIDER, f"read {path} from sandbox {self.remote.sandbox_id}", self.errors):
            return self.remote.files.read(self.options.remote_path(path),
                                          request_timeout=self.options.request_timeout_s)

    def write_file(self, path: str, text: str) -> None:
        self.check_open()
        with service_call(PROVIDER, f"write {path} in sandbox {self.remote.sandbox_id}", self.errors):
            self.remote.files.write(self.options.remote_path(path), text,
                                    request_timeout=self.options.request_timeout_s)

    def check_open(self) -> None:
        if self.closed:
            raise SandboxError(f"e2b sandbox {self.remote.sandbox_id} is closed")

    def close(self) -> None:
        """Kills the sandbox; a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        with service_call(PROVIDER, f"kill of sandbox {self.remote.sandbox_id}", self.errors):
            self.remote.kill(request_timeout=self.options.request_timeout_s)
