"""The E2B provider through the e2b SDK's own code down to its HTTP transport, answered as E2B's services answer.

The SDK sends every request (its REST API's, envd's Connect RPCs and envd's file API) through one pyqwest
transport that `e2b.api.client_sync` builds; `Wire` stands in for it, records each request's method, URL, headers
and body, and answers with what the service sends: JSON for the REST API (`POST /v2/sandboxes`, `DELETE
/sandboxes/{id}`), Connect envelopes of envd's own protobuf messages in their JSON form for the RPCs, a JSON list
of written entries for a multipart upload to `/files`. A request no route expects fails the test, so nothing here
reaches the network, and nothing here has run against E2B (no credentials).
"""

import json
import struct
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("e2b")  # a sandbox extra (make test installs them all)

import e2b.api.client_sync  # noqa: E402
from e2b.envd.filesystem import filesystem_pb  # noqa: E402
from e2b.envd.process import process_pb  # noqa: E402
from protobuf import Oneof  # noqa: E402
from pyqwest import Headers, SyncRequest, SyncResponse  # noqa: E402

from tests.unit.sandbox_wire import Answer, Request, Routes, json_answer  # noqa: E402
from verst.sandbox import SandboxError  # noqa: E402
from verst.sandbox.cloud import shell_line  # noqa: E402
from verst.sandbox.cloud.e2b import E2BOptions, E2BProvider  # noqa: E402

API, ENVD = "api.e2b.app", "sandbox.e2b.app"  # E2B's default domain; envd is reached through its sandbox proxy
SANDBOX_ID, ACCESS_TOKEN, API_KEY = "i1a2b3c4d5e6f7g8h9", "envd-token-1", "e2b_test_key"
END_STREAM = 0x02  # the Connect envelope flag of a stream's last frame, which carries its status


def envelope(flags: int, payload: bytes) -> bytes:
    """One Connect streaming frame: a flags byte, the payload's length as 4 big-endian bytes, the payload."""
    return struct.pack(">BI", flags, len(payload)) + payload


def envelopes(body: bytes) -> list[tuple[int, bytes]]:
    frames = []
    while body:
        flags, length = struct.unpack(">BI", body[:5])
        frames.append((flags, body[5:5 + length]))
        body = body[5 + length:]
    return frames


def multipart_files(request: Request) -> list[tuple[str, bytes]]:
    """The (filename, content) of each file part of an upload to envd's /files."""
    return [(filename, content) for name, filename, content in request.multipart() if name == "file"]


def process_event(kind: str, value) -> bytes:
    """A `StartResponse` frame carrying one envd process event, encoded as envd's JSON codec writes it."""
    message = process_pb.StartResponse(event=process_pb.ProcessEvent(event=Oneof(kind, value)))
    return envelope(0, message.to_json().encode())


def output(stream: str, data: bytes) -> bytes:
    return process_event("data", process_pb.ProcessEvent.DataEvent(output=Oneof(stream, data)))


def process_stream(*frames: bytes, exit_code: int | None = 0, error: dict | None = None) -> Answer:
    """envd's answer to `process.Process/Start`: the start event, `frames`, the end event (unless `exit_code` is
    None) and the end-of-stream frame with `error`, if any."""
    events = [process_event("start", process_pb.ProcessEvent.StartEvent(pid=412)), *frames]
    if exit_code is not None:
        events.append(process_event("end", process_pb.ProcessEvent.EndEvent(
            exit_code=exit_code, exited=True, status=f"exit status {exit_code}")))
    trailer = {"error": error} if error else {}
    return 200, {"content-type": "application/connect+json"}, b"".join(events) + envelope(
        END_STREAM, json.dumps(trailer).encode())


class Wire(Routes):
    """The SDK's transport, with routes answering as E2B's API and a sandbox's envd answer."""

    def __init__(self):
        super().__init__()
        self.files: dict[str, bytes] = {}  # what envd's /files holds
        self.table.update({
            ("POST", API, "/v2/sandboxes"): lambda request: json_answer({
                "templateID": request.json()["templateID"], "sandboxID": SANDBOX_ID, "clientID": "6532622b",
                "envdVersion": "0.6.7", "envdAccessToken": ACCESS_TOKEN, "domain": None}, status=201),
            ("POST", ENVD, "/filesystem.Filesystem/MakeDir"): self.make_dir,
            ("POST", ENVD, "/files"): self.upload,
            ("GET", ENVD, "/files"): self.download,
            ("DELETE", API, f"/sandboxes/{SANDBOX_ID}"): lambda request: (204, {}, b""),
        })

    def make_dir(self, request: Request) -> Answer:
        path = request.json()["path"]
        entry = filesystem_pb.EntryInfo(name=path.rsplit("/", 1)[-1], type=filesystem_pb.FileType.DIRECTORY, path=path)
        return 200, {"content-type": "application/json"}, filesystem_pb.MakeDirResponse(entry=entry).to_json().encode()

    def upload(self, request: Request) -> Answer:
        written = multipart_files(request)
        self.files.update(written)
        return json_answer([{"name": path.rsplit("/", 1)[-1], "type": "file", "path": path} for path, _ in written])

    def download(self, request: Request) -> Answer:
        path = request.query["path"][0]
        if path not in self.files:
            return json_answer({"code": 404, "message": f"path '{path}' does not exist"}, status=404)
        return 200, {"content-type": "application/octet-stream"}, self.files[path]

    def execute_sync(self, sent: SyncRequest) -> SyncResponse:
        content, url = sent.content, urlsplit(sent.url)
        status, headers, body = self.answer(Request(
            sent.method, url.hostname, url.path, parse_qs(url.query), dict(sent.headers.items()),
            content if isinstance(content, bytes) else b"".join(content or [])))
        return SyncResponse(status=status, headers=Headers(headers), content=body)


@pytest.fixture
def wire(monkeypatch):
    """Every pyqwest transport the SDK builds is the `Wire`; the SDK's transport caches start empty."""
    wire = Wire()
    monkeypatch.setattr(e2b.api.client_sync, "SyncHTTPTransport", lambda **settings: wire)
    for cache in ("_transports", "_pools", "_httpx_transports"):
        monkeypatch.setattr(e2b.api.client_sync, cache, {})
    for variable in ("E2B_API_KEY", "E2B_DOMAIN", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(variable, raising=False)
    yield wire
    assert wire.unexpected == []


def start(files: dict[str, str] | None = None, **options) -> tuple:
    return E2BProvider(E2BOptions(**options), api_key=API_KEY).start(files or {})


def assert_envd_headers(request: Request) -> None:
    assert request.headers["x-access-token"] == ACCESS_TOKEN
    assert request.headers["e2b-sandbox-id"] == SANDBOX_ID
    assert request.headers["e2b-sandbox-port"] == "49983"


def test_create_posts_the_template_lifetime_metadata_and_network_with_the_api_key(wire):
    start(template="my-template", lifetime_s=900)
    (create,) = wire.sent("POST", API, "/v2/sandboxes")
    assert create.headers["x-api-key"] == API_KEY
    assert create.headers["content-type"] == "application/json"
    assert create.json() == {"templateID": "my-template", "timeout": 900, "allow_internet_access": False,
                             "metadata": {"created-by": "verst"}, "envVars": {}}
    (make_dir,) = wire.sent("POST", ENVD, "/filesystem.Filesystem/MakeDir")
    assert_envd_headers(make_dir)
    assert "x-api-key" not in make_dir.headers  # the API key goes to E2B's API only, never into the sandbox
    assert (make_dir.headers["content-type"], make_dir.headers["connect-protocol-version"]) == ("application/json", "1")
    assert make_dir.headers["connect-timeout-ms"] == "60000"
    assert make_dir.json() == {"path": "/tmp/workspace"}


def test_network_option_allows_internet_access(wire):
    start(network=True)
    assert wire.sent("POST", API, "/v2/sandboxes")[0].json()["allow_internet_access"] is True


def test_start_uploads_the_files_in_one_multipart_request(wire):
    start({"project.py": "x = 1\n", "tests/test_project.py": "assert True\n"})
    (upload,) = wire.sent("POST", ENVD, "/files")
    assert_envd_headers(upload)
    assert upload.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert multipart_files(upload) == [("/tmp/workspace/project.py", b"x = 1\n"),
                                       ("/tmp/workspace/tests/test_project.py", b"assert True\n")]
    assert [r.path for r in wire.requests] == ["/v2/sandboxes", "/filesystem.Filesystem/MakeDir", "/files"]


def test_exec_starts_the_command_in_the_workspace_and_reads_its_stream(wire):
    sandbox = start()
    wire.on("POST", ENVD, "/process.Process/Start", lambda request: process_stream(
        output("stdout", b"out\n"), output("stderr", b"err\n"), output("stdout", b"more\n")))
    result = sandbox.exec("echo out; echo err >&2; echo more", timeout_s=7.5)
    (run,) = wire.sent("POST", ENVD, "/process.Process/Start")
    assert_envd_headers(run)
    assert run.headers["content-type"] == "application/connect+json"
    assert run.headers["connect-timeout-ms"] == "7500"
    ((flags, payload),) = envelopes(run.body)
    assert flags == 0
    assert json.loads(payload) == {"process": {"cmd": "/bin/bash", "args": [
        "-l", "-c", shell_line("echo out; echo err >&2; echo more")], "cwd": "/tmp/workspace"}, "stdin": False}
    assert (result.exit_code, result.output, result.timed_out, result.truncated) == (0, "out\nerr\nmore\n", False,
                                                                                     False)


def test_exec_reports_a_nonzero_exit_and_caps_the_output(wire):
    sandbox = start(output_bytes=10)
    wire.on("POST", ENVD, "/process.Process/Start", lambda request: process_stream(
        output("stdout", b"0123456789"), output("stderr", b"abc"), exit_code=2))
    result = sandbox.exec("false", timeout_s=5)
    assert (result.exit_code, result.output, result.timed_out, result.truncated) == (2, "0123456789", False, True)


def test_exec_past_its_deadline_is_timed_out_with_the_output_so_far(wire):
    sandbox = start()
    wire.on("POST", ENVD, "/process.Process/Start", lambda request: process_stream(
        output("stdout", b"started\n"), exit_code=None,
        error={"code": "deadline_exceeded", "message": "context deadline exceeded"}))
    result = sandbox.exec("echo started; sleep 30", timeout_s=1)
    assert (result.exit_code, result.output, result.timed_out) == (-9, "started\n", True)


def test_exec_refused_by_envd_is_a_sandbox_error(wire):
    sandbox = start()
    wire.on("POST", ENVD, "/process.Process/Start", lambda request: json_answer(
        {"code": "invalid_argument", "message": "invalid working directory"}, status=400))
    with pytest.raises(SandboxError, match=f"e2b exec in sandbox {SANDBOX_ID} failed: .*invalid working directory"):
        sandbox.exec("true", timeout_s=1)


def test_read_and_write_go_to_envds_file_api(wire):
    sandbox = start({"a.py": "x = 1\n"})
    sandbox.write_file("/tmp/workspace/sub/c.py", "z = 3\n")
    write = wire.sent("POST", ENVD, "/files")[-1]
    assert_envd_headers(write)
    assert write.query == {"path": ["/tmp/workspace/sub/c.py"]}
    assert multipart_files(write) == [("/tmp/workspace/sub/c.py", b"z = 3\n")]
    assert sandbox.read_file("sub/c.py") == "z = 3\n"
    read = wire.sent("GET", ENVD, "/files")[-1]
    assert_envd_headers(read)
    assert read.query == {"path": ["/tmp/workspace/sub/c.py"]}
    with pytest.raises(SandboxError, match=f"e2b read missing.py from sandbox {SANDBOX_ID} failed: .*does not exist"):
        sandbox.read_file("missing.py")


def test_close_deletes_the_sandbox_once_with_the_api_key(wire):
    sandbox = start()
    sandbox.close()
    sandbox.close()
    (kill,) = wire.sent("DELETE", API, f"/sandboxes/{SANDBOX_ID}")
    assert kill.headers["x-api-key"] == API_KEY
    with pytest.raises(SandboxError, match="is closed"):
        sandbox.exec("true", timeout_s=1)


@pytest.mark.parametrize(("status", "message", "error"), [
    (400, "template 'nope' not found", "SandboxException"),
    (401, "Invalid API key", "AuthenticationException"),
    (429, "too many sandboxes", "RateLimitException"),
    (500, "internal error", "SandboxException"),
    (503, "no capacity", "ServiceBusyException"),
])
def test_api_errors_on_create_are_sandbox_errors(wire, status, message, error):
    wire.on("POST", API, "/v2/sandboxes", lambda request: json_answer({"code": status, "message": message}, status))
    with pytest.raises(SandboxError, match=f"e2b create failed: {error}: .*{message}"):
        start()
    assert wire.sent("POST", ENVD, "/filesystem.Filesystem/MakeDir") == []


def test_a_failed_upload_kills_the_sandbox(wire):
    wire.on("POST", ENVD, "/files", lambda request: json_answer(
        {"code": 507, "message": "not enough disk space"}, status=507))
    with pytest.raises(SandboxError, match=f"e2b upload to sandbox {SANDBOX_ID} failed: .*not enough disk space"):
        start({"a.py": "x\n"})
    assert len(wire.sent("DELETE", API, f"/sandboxes/{SANDBOX_ID}")) == 1


def refuse_connection(request: Request) -> Answer:
    raise ConnectionError("connection refused")  # what pyqwest raises when no connection could be made


def test_an_unreachable_api_is_a_sandbox_error(wire, monkeypatch):
    monkeypatch.setattr(e2b.api.client_sync, "connection_retries", 0)  # the SDK's three tries take seconds
    wire.on("POST", API, "/v2/sandboxes", refuse_connection)
    with pytest.raises(SandboxError, match="e2b create failed: ConnectError: connection refused"):
        start()


def test_a_connection_lost_during_exec_is_a_sandbox_error(wire):
    sandbox = start()
    wire.on("POST", ENVD, "/process.Process/Start", refuse_connection)
    wire.on("GET", ENVD, "/health", lambda request: (204, {}, b""))  # the SDK's probe: the sandbox still runs
    with pytest.raises(SandboxError, match=f"e2b exec in sandbox {SANDBOX_ID} failed: ConnectError: "):
        sandbox.exec("true", timeout_s=1)
    assert_envd_headers(wire.sent("GET", ENVD, "/health")[0])
