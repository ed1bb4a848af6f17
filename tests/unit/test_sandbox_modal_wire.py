"""The Modal provider through the modal SDK's own code down to gRPC, against a grpclib server on 127.0.0.1.

The SDK's client is pointed at the server by MODAL_SERVER_URL (a localhost server also lets the SDK reach the
sandbox's task command router over plain HTTP/2). The server implements, with Modal's own servicer base classes
and messages (`modal_proto`), the control-plane calls the provider makes (`AppGetOrCreate`,
`EnvironmentGetOrCreate`, `ImageGetOrCreate`, `AuthTokenGet`, `SandboxCreateV2`, `SandboxTerminateV2`) and the
router's exec calls (`TaskExecStart`, `TaskExecStdinWriteStream`, `TaskExecStdioRead`, `TaskExecWait`), through which the
SDK also runs the sandbox's file tool for `make_directory`, `write_text` and `read_text`. Every other method answers
UNIMPLEMENTED and fails the test, and a name lookup of any host but 127.0.0.1 fails too, so nothing here reaches the
network, and nothing here has run against Modal (no credentials).
"""

import asyncio
import base64
import json
import socket
import threading
from dataclasses import dataclass, field

import pytest

pytest.importorskip("modal")  # a sandbox extra (make test installs them all)

import grpclib.server  # noqa: E402
import modal.client  # noqa: E402
from grpclib import GRPCError, Status  # noqa: E402
from modal_proto import api_grpc, api_pb2  # noqa: E402
from modal_proto import task_command_router_grpc as router_grpc  # noqa: E402
from modal_proto import task_command_router_pb2 as router_pb2  # noqa: E402

from verst.sandbox import SandboxError  # noqa: E402
from verst.sandbox.cloud import shell_argv  # noqa: E402
from verst.sandbox.cloud.modal import ModalOptions, ModalProvider  # noqa: E402

TOKEN_ID, TOKEN_SECRET = "ak-test1", "as-test1"
SANDBOX_ID, TASK_ID, APP_ID, IMAGE_ID = "sb-2a9f5c7e1d3b", "ta-01TEST", "ap-verst1", "im-slim1"
FS_TOOLS = "/__modal/.bin/modal-sandbox-fs-tools"  # the SDK's file operations run this tool in the sandbox


def unsigned_jwt(claims: dict) -> str:
    """A JWT the SDK can read an expiry from (it never checks the signature)."""
    def part(payload: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none'})}.{part(claims)}.signature"


AUTH_TOKEN = unsigned_jwt({"exp": 4102444800})  # 2100-01-01
ROUTER_JWT = unsigned_jwt({"exp": 4102444800, "task_id": TASK_ID})


@dataclass
class Exec:
    """A command the router started, and what it did."""

    request: router_pb2.TaskExecStartRequest
    stdin: bytearray = field(default_factory=bytearray)
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    exit_code: int | None = None
    killed_by: int | None = None  # the signal that ended it
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    def end(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self.finished.set()


@dataclass
class Command:
    """How the sandbox answers a user command: its output chunks, then its exit code (None: it runs until the
    router's `timeout_secs` kills it)."""

    chunks: list[bytes]
    exit_code: int | None = 0
    kill_late_s: float = 0  # how long after `timeout_secs` the kill reaches the client


class ModalService:
    """Modal's control plane and a sandbox's task command router on one grpclib server."""

    def __init__(self):
        self.calls: list[tuple[str, object, dict]] = []  # (method, request, metadata)
        self.unexpected: list[str] = []
        self.execs: dict[str, Exec] = {}
        self.files: dict[str, bytes] = {}
        self.directories: set[str] = set()
        self.command = Command([])
        self.providers: list[ModalProvider] = []  # their clients are closed with the server
        self.refusals: dict[str, GRPCError] = {}  # a method's error answer
        self.start_reply_delay_s = 0.0  # how long TaskExecStart's reply takes to reach the client
        self.port = 0

    def requests(self, method: str) -> list:
        return [request for name, request, _ in self.calls if name == method]

    def metadata(self, method: str) -> list[dict]:
        return [metadata for name, _, metadata in self.calls if name == method]

    def user_execs(self) -> list[Exec]:
        return [e for e in self.execs.values() if e.request.command_args[0] != FS_TOOLS]

    async def start(self) -> int:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        self.port = listening.getsockname()[1]
        self.server = grpclib.server.Server([ControlPlane(self), Router(self)])
        await self.server.start(sock=listening)
        return self.port

    async def stop(self) -> None:
        self.server.close()
        await asyncio.wait_for(self.server.wait_closed(), 5)

    async def received(self, name: str, stream):
        request = await stream.recv_message()
        self.calls.append((name, request, dict(stream.metadata)))
        if name in self.refusals:
            raise self.refusals[name]
        return request

    def run_file_tool(self, run: Exec) -> None:
        """The sandbox's file tool: one JSON operation in its second argument, file data on stdin and stdout."""
        ((operation, arguments),) = json.loads(run.request.command_args[1]).items()
        path = arguments["path"]
        if operation == "MakeDirectory":
            self.directories.add(path)
        elif operation == "WriteFile":
            self.files[path] = bytes(run.stdin)
        elif operation == "ReadFile" and path in self.files:
            run.stdout += self.files[path]
        elif operation == "ReadFile":
            run.stderr += json.dumps({"error_kind": "NotFound", "message": "No such file or directory"}).encode()
            return run.end(1)
        else:
            raise AssertionError(f"the file tool was asked for {operation}")
        run.end(0)

    async def run_command(self, run: Exec) -> None:
        for chunk in self.command.chunks:
            run.stdout += chunk
        if self.command.exit_code is not None:
            return run.end(self.command.exit_code)
        # The router kills the command once `timeout_secs` have passed since its start request.
        await asyncio.sleep(run.request.timeout_secs + self.command.kill_late_s)
        run.killed_by = 9
        run.finished.set()


def refuse_unimplemented(base: type) -> type:
    """`base` with every method answering UNIMPLEMENTED and recording it, for subclasses to override."""
    def refuse(name: str):
        async def method(self, stream) -> None:
            await stream.recv_message()
            self.service.unexpected.append(name)
            raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not served here")
        return method

    return type(f"Refusing{base.__name__}", (base,), {name: refuse(name) for name in base.__abstractmethods__})


class ControlPlane(refuse_unimplemented(api_grpc.ModalClientBase)):
    def __init__(self, service: ModalService):
        self.service = service

    async def AppGetOrCreate(self, stream) -> None:
        await self.service.received("AppGetOrCreate", stream)
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=APP_ID))

    async def EnvironmentGetOrCreate(self, stream) -> None:
        await self.service.received("EnvironmentGetOrCreate", stream)
        settings = api_pb2.EnvironmentSettings(image_builder_version="2026.10")
        await stream.send_message(api_pb2.EnvironmentGetOrCreateResponse(
            environment_id="en-main", metadata=api_pb2.EnvironmentMetadata(name="main", settings=settings)))

    async def ImageGetOrCreate(self, stream) -> None:
        await self.service.received("ImageGetOrCreate", stream)
        built = api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS)
        await stream.send_message(api_pb2.ImageGetOrCreateResponse(image_id=IMAGE_ID, result=built))

    async def AuthTokenGet(self, stream) -> None:
        await self.service.received("AuthTokenGet", stream)
        await stream.send_message(api_pb2.AuthTokenGetResponse(token=AUTH_TOKEN))

    async def SandboxCreateV2(self, stream) -> None:
        await self.service.received("SandboxCreateV2", stream)
        access = api_pb2.CommandRouterAccess(url=f"http://127.0.0.1:{self.service.port}", jwt=ROUTER_JWT)
        await stream.send_message(api_pb2.SandboxCreateV2Response(
            sandbox_id=SANDBOX_ID, task_id=TASK_ID, command_router_access=access))

    async def SandboxTerminateV2(self, stream) -> None:
        await self.service.received("SandboxTerminateV2", stream)
        await stream.send_message(api_pb2.SandboxTerminateResponse())


class Router(refuse_unimplemented(router_grpc.TaskCommandRouterBase)):
    def __init__(self, service: ModalService):
        self.service = service

    async def TaskExecStart(self, stream) -> None:
        request = await self.service.received("TaskExecStart", stream)
        run = self.service.execs[request.exec_id] = Exec(request)
        if request.command_args[0] != FS_TOOLS:
            asyncio.get_running_loop().create_task(self.service.run_command(run))
            await asyncio.sleep(self.service.start_reply_delay_s)
        elif "WriteFile" not in request.command_args[1]:  # a write runs once its stdin is closed
            self.service.run_file_tool(run)
        await stream.send_message(router_pb2.TaskExecStartResponse())

    async def TaskExecStdinWriteStream(self, stream) -> None:
        """A start message naming the exec and the offset, the data, and an end message that closes stdin."""
        opening = await self.service.received("TaskExecStdinWriteStream", stream)
        run = self.service.execs[opening.start.exec_id]
        assert opening.start.offset == len(run.stdin), f"stdin from {opening.start.offset}, {len(run.stdin)} held"
        async for message in stream:
            if message.WhichOneof("payload") == "data":
                run.stdin += message.data
            elif message.WhichOneof("payload") == "end":
                self.service.run_file_tool(run)
        await stream.send_message(router_pb2.TaskExecStdinWriteStreamResponse())

    async def TaskExecStdioRead(self, stream) -> None:
        """What the command has written from the offset asked, as it comes, until the command ends."""
        request = await self.service.received("TaskExecStdioRead", stream)
        run = self.service.execs[request.exec_id]
        stdout = request.file_descriptor == router_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT
        offset = request.offset
        while True:
            ended = run.finished.is_set()
            out = run.stdout if stdout else run.stderr
            if offset < len(out):
                await stream.send_message(router_pb2.TaskExecStdioReadResponse(data=bytes(out[offset:])))
                offset = len(out)
            if ended:
                return
            await run.finished.wait()

    async def TaskExecWait(self, stream) -> None:
        request = await self.service.received("TaskExecWait", stream)
        run = self.service.execs[request.exec_id]
        await run.finished.wait()
        if run.killed_by is not None:
            await stream.send_message(router_pb2.TaskExecWaitResponse(signal=run.killed_by))
        else:
            await stream.send_message(router_pb2.TaskExecWaitResponse(code=run.exit_code))


@pytest.fixture
def service(monkeypatch):
    """The server on its own event loop thread; the SDK pointed at it, and no name but 127.0.0.1 resolvable."""
    service = ModalService()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(service.start(), loop).result(10)
    monkeypatch.setenv("MODAL_SERVER_URL", f"http://127.0.0.1:{port}")
    for variable in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_ENVIRONMENT", "MODAL_PROFILE"):
        monkeypatch.delenv(variable, raising=False)
    resolve = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        assert host == "127.0.0.1", f"the SDK looked up {host}"
        return resolve(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    yield service
    for provider in service.providers:
        provider.client.close()
    asyncio.run_coroutine_threadsafe(service.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    assert service.unexpected == []


def start(service: ModalService, files: dict[str, str] | None = None, **options):
    provider = ModalProvider(ModalOptions(**options), token_id=TOKEN_ID, token_secret=TOKEN_SECRET)
    service.providers.append(provider)
    return provider.start(files or {})


def test_create_looks_up_the_app_builds_the_image_and_creates_the_sandbox(service):
    start(service, image="python:3.12-slim", cpu=2.0, memory_mib=2048, lifetime_s=1200, idle_timeout_s=60)
    (app,) = service.requests("AppGetOrCreate")
    assert (app.app_name, app.object_creation_type) == ("verst-sandboxes",
                                                        api_pb2.OBJECT_CREATION_TYPE_CREATE_IF_MISSING)
    assert service.metadata("AppGetOrCreate")[0]["x-modal-token-id"] == TOKEN_ID
    assert service.metadata("AppGetOrCreate")[0]["x-modal-token-secret"] == TOKEN_SECRET
    (image,) = service.requests("ImageGetOrCreate")
    assert image.image.dockerfile_commands[0] == "FROM python:3.12-slim"
    (create,) = service.requests("SandboxCreateV2")
    assert service.metadata("SandboxCreateV2")[0]["x-modal-auth-token"] == AUTH_TOKEN
    definition = create.definition
    assert (create.app_id, definition.image_id, definition.workdir) == (APP_ID, IMAGE_ID, "/tmp/workspace")
    assert (definition.resources.milli_cpu, definition.resources.memory_mb) == (2000, 2048)
    assert (definition.timeout_secs, definition.idle_timeout_secs) == (1200, 60)
    assert definition.network_access.network_access_type == api_pb2.NetworkAccess.BLOCKED
    assert [(tag.tag_name, tag.tag_value) for tag in create.tags] == [("created-by", "verst")]


def test_network_option_opens_the_network(service):
    start(service, network=True)
    definition = service.requests("SandboxCreateV2")[0].definition
    assert definition.network_access.network_access_type == api_pb2.NetworkAccess.OPEN


def test_start_makes_the_workspace_and_writes_the_files_through_the_router(service):
    start(service, {"project.py": "x = 1\n", "tests/test_project.py": "assert True\n"})
    assert service.directories == {"/tmp/workspace"}
    assert service.files == {"/tmp/workspace/project.py": b"x = 1\n",
                             "/tmp/workspace/tests/test_project.py": b"assert True\n"}
    starts = service.requests("TaskExecStart")
    assert {request.task_id for request in starts} == {TASK_ID}
    assert [json.loads(request.command_args[1]) for request in starts] == [
        {"MakeDirectory": {"path": "/tmp/workspace", "parents": True}},
        {"WriteFile": {"path": "/tmp/workspace/project.py"}},
        {"WriteFile": {"path": "/tmp/workspace/tests/test_project.py"}}]
    assert {m["authorization"] for m in service.metadata("TaskExecStart")} == {f"Bearer {ROUTER_JWT}"}


def test_exec_runs_the_command_in_the_workspace_and_reads_its_output(service):
    sandbox = start(service, output_bytes=6)
    service.command = Command([b"abc", b"def", b"ghi"], exit_code=4)
    result = sandbox.exec("exit 4", timeout_s=2.5)
    (run,) = service.user_execs()
    assert list(run.request.command_args) == shell_argv("exit 4")
    assert (run.request.workdir, run.request.timeout_secs) == ("/tmp/workspace", 3)
    assert run.request.stdout_config == router_pb2.TASK_EXEC_STDOUT_CONFIG_PIPE
    assert (result.exit_code, result.output, result.timed_out, result.truncated) == (4, "abcdef", False, True)


# The SDK's own exec deadline starts when TaskExecStart's reply arrives, the router's kill timer when the request
# did: whichever ends the command first, -1 (the SDK's deadline) or 128 + SIGKILL (the router's kill), is a timeout.
@pytest.mark.parametrize(("start_reply_delay_s", "kill_late_s"), [(0.3, 0), (0, 0.3)],
                         ids=["the router's kill first", "the SDK's deadline first"])
def test_exec_past_its_timeout_is_timed_out_with_the_output_so_far(service, start_reply_delay_s, kill_late_s):
    sandbox = start(service)
    service.start_reply_delay_s = start_reply_delay_s
    service.command = Command([b"started\n"], exit_code=None, kill_late_s=kill_late_s)
    result = sandbox.exec("echo started; sleep 30", timeout_s=1)
    assert (result.exit_code, result.output, result.timed_out) == (-9, "started\n", True)


def test_a_command_killed_before_its_timeout_is_not_timed_out(service):
    sandbox = start(service)
    service.command = Command([b"Killed\n"], exit_code=128 + 9)  # e.g. the kernel's OOM killer
    result = sandbox.exec("python train.py", timeout_s=30)
    assert (result.exit_code, result.timed_out) == (137, False)


def test_read_and_write_go_through_the_file_tool(service):
    sandbox = start(service)
    sandbox.write_file("sub/c.py", "z = 3\n")
    assert service.files == {"/tmp/workspace/sub/c.py": b"z = 3\n"}
    assert sandbox.read_file("/tmp/workspace/sub/c.py") == "z = 3\n"
    read = service.requests("TaskExecStart")[-1]
    assert json.loads(read.command_args[1]) == {"ReadFile": {"path": "/tmp/workspace/sub/c.py"}}
    with pytest.raises(SandboxError, match=f"modal read missing.py from sandbox {SANDBOX_ID} failed: "
                                           "SandboxFilesystemNotFoundError: No such file"):
        sandbox.read_file("missing.py")


def test_close_terminates_the_sandbox_once(service):
    sandbox = start(service)
    sandbox.close()
    sandbox.close()
    assert [request.sandbox_id for request in service.requests("SandboxTerminateV2")] == [SANDBOX_ID]


@pytest.mark.parametrize(("method", "status", "message", "raised"), [
    ("AppGetOrCreate", Status.UNAUTHENTICATED, "Token ID is malformed", "create failed: AuthError: Token ID"),
    ("SandboxCreateV2", Status.RESOURCE_EXHAUSTED, "Sandbox limit reached",
     "create failed: ResourceExhaustedError: Sandbox limit"),
    ("SandboxCreateV2", Status.INVALID_ARGUMENT, "Invalid memory request", "create failed: InvalidError: Invalid mem"),
    # The SDK reports a router error during a file operation as a SandboxFilesystemError of its own wording.
    ("TaskExecStart", Status.PERMISSION_DENIED, "JWT does not grant this task",
     f"upload to sandbox {SANDBOX_ID} failed: SandboxFilesystemError: "),
])
def test_grpc_errors_are_sandbox_errors(service, method, status, message, raised):
    service.refusals[method] = GRPCError(status, message)
    with pytest.raises(SandboxError, match=f"modal {raised}"):
        start(service)
    if method == "TaskExecStart":  # a sandbox whose upload failed is terminated
        assert [request.sandbox_id for request in service.requests("SandboxTerminateV2")] == [SANDBOX_ID]


def test_credentials_from_the_environment_reach_the_control_plane(service, monkeypatch):
    monkeypatch.setattr(modal.client._Client, "_client_from_env", None)  # the SDK keeps one client per process
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-from-env")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-from-env")
    ModalProvider(ModalOptions()).start({})
    metadata = service.metadata("AppGetOrCreate")[0]
    assert (metadata["x-modal-token-id"], metadata["x-modal-token-secret"]) == ("ak-from-env", "as-from-env")
    modal.Client.from_env().close()
