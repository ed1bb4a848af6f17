"""The Daytona provider through the daytona SDK's own code down to its HTTP transports, answered as Daytona answers.

The SDK's generated clients (the API's and the sandbox toolbox's) send through urllib3's pool manager, whose
`urlopen` is replaced here; its file transfers go through an httpx client, answered by respx (any request it has no
route for raises). Both record each request's method, URL, headers and body into one `Routes` that answers with
what the service sends: the API's `Sandbox` JSON for a create or a delete, the toolbox's `ExecuteResponse` JSON
for an exec (a 408 with the daemon's `PROCESS_EXECUTION_TIMEOUT` past its timeout), a multipart body of the files
for a bulk download. A request no route expects fails the test, so nothing here reaches the network, and nothing
here has run against Daytona (no credentials).
"""

import io
import json
from urllib.parse import parse_qs, urlsplit

import pytest

pytest.importorskip("daytona")  # a sandbox extra (make test installs them all)
pytest.importorskip("respx")  # a sandbox extra (make test installs them all)

import httpx  # noqa: E402
import respx  # noqa: E402
import urllib3  # noqa: E402

from tests.unit.sandbox_wire import Answer, Request, Routes, json_answer, multipart_answer  # noqa: E402
from verst.sandbox import SandboxError  # noqa: E402
from verst.sandbox.cloud import shell_line  # noqa: E402
from verst.sandbox.cloud.daytona import DaytonaOptions, DaytonaProvider  # noqa: E402

# The SDK reads its own deprecated `server_url` field whenever no API URL is given, as the provider's default is.
pytestmark = pytest.mark.filterwarnings("ignore:`server_url` is deprecated:DeprecationWarning")

API, TOOLBOX = "app.daytona.io", "proxy.app.daytona.io"  # Daytona's cloud; the toolbox URL comes in the Sandbox
SANDBOX_ID, API_KEY = "4b6e1c2a-sandbox", "dtn_test_key"
FILES_PATH = f"/toolbox/{SANDBOX_ID}/files"
SOURCE = "DAYTONA_DAEMON"  # the `source` of the toolbox daemon's errors


def sandbox_json(body: dict, state: str) -> dict:
    """The API's `Sandbox` for a create request's `body` (the fields its model requires, and the ones asked)."""
    return {"id": SANDBOX_ID, "organizationId": "org-1", "name": SANDBOX_ID, "user": "daytona",
            "snapshot": body.get("snapshot"), "env": body.get("env", {}), "labels": body.get("labels", {}),
            "public": False, "networkBlockAll": body.get("networkBlockAll", False), "kvm": False,
            "target": body.get("target", "us"), "cpu": body.get("cpu", 1), "gpu": 0, "memory": body.get("memory", 1),
            "disk": body.get("disk", 3), "state": state, "autoStopInterval": body.get("autoStopInterval", 15),
            "toolboxProxyUrl": f"https://{TOOLBOX}/toolbox"}


def daemon_error(status: int, code: str, message: str) -> Answer:
    """The toolbox daemon's error envelope."""
    return json_answer({"statusCode": status, "code": code, "source": SOURCE, "message": message,
                        "timestamp": "2026-01-01T00:00:00Z", "path": "/process/execute", "method": "POST"}, status)


class Service(Routes):
    """Daytona's API and a sandbox's toolbox: a sandbox is created started, files land in `files`."""

    def __init__(self):
        super().__init__()
        self.files: dict[str, bytes] = {}
        self.created: dict = {}
        self.table.update({
            ("POST", API, "/api/sandbox"): self.create,
            ("POST", TOOLBOX, f"{FILES_PATH}/folder"): lambda request: (201, {}, b""),
            ("POST", TOOLBOX, f"{FILES_PATH}/bulk-upload"): self.upload,
            ("POST", TOOLBOX, f"{FILES_PATH}/bulk-download"): self.download,
            ("DELETE", API, f"/api/sandbox/{SANDBOX_ID}"): lambda request: json_answer(
                sandbox_json(self.created, "destroying")),
        })

    def create(self, request: Request) -> Answer:
        self.created = request.json()
        return json_answer(sandbox_json(self.created, "started"))

    def upload(self, request: Request) -> Answer:
        parts = request.multipart()  # files[i].path, then files[i].file, for each file
        paths = {name.removesuffix(".path"): content.decode() for name, _, content in parts if name.endswith(".path")}
        for name, _, content in parts:
            if name.endswith(".file"):
                self.files[paths[name.removesuffix(".file")]] = content
        return 200, {}, b""

    def download(self, request: Request) -> Answer:
        def part(path: str) -> tuple[str, str, str, bytes]:
            if path in self.files:
                return "file", path, "application/octet-stream", self.files[path]
            return "error", path, "application/json", json.dumps({
                "statusCode": 404, "code": "FILE_NOT_FOUND", "source": SOURCE, "message": f"file not found: {path}"
            }).encode()

        return multipart_answer([part(path) for path in request.json()["paths"]])

    def urlopen(self, pool: urllib3.PoolManager, method: str, url: str, redirect: bool = True, **sent):
        """urllib3's `PoolManager.urlopen`, as the generated clients call it."""
        parts, body = urlsplit(url), sent.get("body")
        status, headers, content = self.answer(Request(
            method, parts.hostname, parts.path, parse_qs(parts.query),
            {name.lower(): value for name, value in (sent.get("headers") or {}).items()},
            body.encode() if isinstance(body, str) else body or b""))
        return urllib3.HTTPResponse(body=io.BytesIO(content), status=status, headers=headers,
                                    preload_content=sent.get("preload_content", True))

    def httpx_answer(self, sent: httpx.Request) -> httpx.Response:
        status, headers, content = self.answer(Request(
            sent.method, sent.url.host, sent.url.path, parse_qs(sent.url.query.decode()),
            dict(sent.headers.items()), sent.read()))
        return httpx.Response(status, headers=headers, content=content)


@pytest.fixture
def service(monkeypatch):
    service = Service()
    monkeypatch.setattr(urllib3.PoolManager, "urlopen", lambda pool, *args, **kwargs: service.urlopen(
        pool, *args, **kwargs))
    for variable in ("DAYTONA_API_KEY", "DAYTONA_API_URL", "DAYTONA_TARGET", "DAYTONA_JWT_TOKEN",
                     "DAYTONA_ORGANIZATION_ID"):
        monkeypatch.delenv(variable, raising=False)
    with respx.mock(assert_all_mocked=True, assert_all_called=False) as router:
        router.route().mock(side_effect=service.httpx_answer)
        yield service
    assert service.unexpected == []


def start(files: dict[str, str] | None = None, **options):
    return DaytonaProvider(DaytonaOptions(**options), api_key=API_KEY).start(files or {})


def assert_authorized(request: Request) -> None:
    assert request.headers["authorization"] == f"Bearer {API_KEY}"


def test_create_from_an_image_sends_its_dockerfile_resources_labels_and_lifetime(service):
    start(image="python:3.12-slim", cpu=2, memory_gib=4, disk_gib=8, lifetime_s=600, idle_minutes=5)
    (create,) = service.sent("POST", API, "/api/sandbox")
    assert_authorized(create)
    assert create.headers["content-type"] == "application/json"
    body = create.json()
    assert body["buildInfo"] == {"dockerfileContent": "FROM python:3.12-slim\n"}
    assert (body["cpu"], body["memory"], body["disk"]) == (2, 4, 8)
    assert body["labels"]["created-by"] == "verst"
    assert (body["networkBlockAll"], body["autoStopInterval"], body["ttlMinutes"]) == (True, 5, 10)
    assert body["autoDeleteInterval"] == 0  # ephemeral: deleted as soon as it stops
    assert "snapshot" not in body


def test_create_from_a_snapshot_sends_no_resources_and_the_target(service):
    DaytonaProvider(DaytonaOptions(snapshot="my-snap", network=True, target="eu"), api_key=API_KEY).start({})
    body = service.sent("POST", API, "/api/sandbox")[0].json()
    assert (body["snapshot"], body["target"], body["networkBlockAll"], body["ttlMinutes"]) == (
        "my-snap", "eu", False, 60)
    assert not {"cpu", "memory", "disk", "buildInfo"} & body.keys()


def test_start_makes_the_workspace_and_uploads_the_files_to_the_toolbox(service):
    start({"project.py": "x = 1\n", "tests/test_project.py": "assert True\n"})
    (folder,) = service.sent("POST", TOOLBOX, f"{FILES_PATH}/folder")
    assert_authorized(folder)
    assert folder.query == {"path": ["/tmp/workspace"], "mode": ["755"]}
    (upload,) = service.sent("POST", TOOLBOX, f"{FILES_PATH}/bulk-upload")
    assert_authorized(upload)
    assert service.files == {"/tmp/workspace/project.py": b"x = 1\n",
                             "/tmp/workspace/tests/test_project.py": b"assert True\n"}


def test_exec_sends_the_command_cwd_and_whole_second_timeout(service):
    sandbox = start(output_bytes=8)
    service.on("POST", TOOLBOX, f"/toolbox/{SANDBOX_ID}/process/execute",
               lambda request: json_answer({"exitCode": 3, "result": "0123456789"}))
    result = sandbox.exec("cat a.py; exit 3", timeout_s=2.5)
    (run,) = service.sent("POST", TOOLBOX, f"/toolbox/{SANDBOX_ID}/process/execute")
    assert_authorized(run)
    assert run.json() == {"command": shell_line("cat a.py; exit 3"), "cwd": "/tmp/workspace", "timeout": 3}
    assert (result.exit_code, result.output, result.timed_out, result.truncated) == (3, "01234567", False, True)


def test_exec_past_its_timeout_is_timed_out(service):
    sandbox = start()
    service.on("POST", TOOLBOX, f"/toolbox/{SANDBOX_ID}/process/execute", lambda request: daemon_error(
        408, "PROCESS_EXECUTION_TIMEOUT", "command execution timeout after 1 seconds"))
    result = sandbox.exec("sleep 30", timeout_s=1)
    assert (result.exit_code, result.output, result.timed_out) == (-9, "", True)


def test_exec_failing_in_the_daemon_is_a_sandbox_error(service):
    sandbox = start()
    service.on("POST", TOOLBOX, f"/toolbox/{SANDBOX_ID}/process/execute", lambda request: daemon_error(
        502, "", "Command failed: fork/exec /bin/sh: no such file or directory"))
    with pytest.raises(SandboxError, match=f"daytona exec in sandbox {SANDBOX_ID} failed: DaytonaBadGatewayError: "
                                           ".*no such file or directory"):
        sandbox.exec("true", timeout_s=1)


def test_read_and_write_go_through_the_toolbox_bulk_file_routes(service):
    sandbox = start()
    sandbox.write_file("sub/c.py", "z = 3\n")
    assert service.files == {"/tmp/workspace/sub/c.py": b"z = 3\n"}
    assert sandbox.read_file("/tmp/workspace/sub/c.py") == "z = 3\n"
    (download,) = service.sent("POST", TOOLBOX, f"{FILES_PATH}/bulk-download")
    assert_authorized(download)
    assert download.json() == {"paths": ["/tmp/workspace/sub/c.py"]}
    with pytest.raises(SandboxError, match=f"daytona read missing.py from sandbox {SANDBOX_ID} failed: "
                                           "DaytonaFileNotFoundError: .*file not found"):
        sandbox.read_file("missing.py")


def test_close_deletes_the_sandbox_once(service):
    sandbox = start()
    sandbox.close()
    sandbox.close()
    (delete,) = service.sent("DELETE", API, f"/api/sandbox/{SANDBOX_ID}")
    assert_authorized(delete)


@pytest.mark.parametrize(("status", "message", "error"), [
    (400, "Invalid snapshot", "DaytonaBadRequestError"),
    (401, "Invalid API key", "DaytonaAuthenticationError"),
    (403, "Total CPU quota exceeded", "DaytonaForbiddenError"),
    (429, "Too many requests", "DaytonaRateLimitError"),
    (500, "Internal server error", "DaytonaInternalServerError"),
    (503, "No available runners", "DaytonaServiceUnavailableError"),
])
def test_api_errors_on_create_are_sandbox_errors(service, status, message, error):
    service.on("POST", API, "/api/sandbox", lambda request: json_answer(
        {"statusCode": status, "message": message, "error": "Error"}, status))
    with pytest.raises(SandboxError, match=f"daytona create failed: {error}: .*{message}"):
        start()
    assert service.sent("POST", TOOLBOX, f"{FILES_PATH}/folder") == []


def test_a_failed_upload_deletes_the_sandbox(service):
    service.on("POST", TOOLBOX, f"{FILES_PATH}/bulk-upload", lambda request: json_answer(
        {"statusCode": 507, "message": "no space left on device"}, 507))
    with pytest.raises(SandboxError, match=f"daytona upload to sandbox {SANDBOX_ID} failed: .*no space left"):
        start({"a.py": "x\n"})
    assert len(service.sent("DELETE", API, f"/api/sandbox/{SANDBOX_ID}")) == 1


def test_an_unreachable_api_is_a_sandbox_error(service):
    def refuse(request: Request) -> Answer:  # what urllib3's pool manager raises once its connection retries are spent
        raise urllib3.exceptions.MaxRetryError(None, "/api/sandbox", ConnectionRefusedError("connection refused"))

    service.on("POST", API, "/api/sandbox", refuse)
    with pytest.raises(SandboxError, match="daytona create failed: DaytonaError: .*connection refused"):
        start()
