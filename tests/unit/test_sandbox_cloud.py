"""The Daytona, E2B and Modal providers against their SDKs, with no credentials and no network.

Each test replaces the SDK's sandbox client (`daytona.Daytona`, `e2b.Sandbox.create`, `modal.Sandbox.create` and
`modal.App.lookup`) with a fake that records every call and answers as the service would, including the SDK's
own error and timeout types; the parameter objects the providers build (Daytona's create params, resources and
file uploads, Modal's image) are the SDKs' real classes. The SDKs' transports below that client (Daytona's REST
calls, E2B's Connect RPC, Modal's gRPC) are exercised by the `test_sandbox_*_wire.py` tests, and no test runs
against the services.
"""

import pytest

pytest.importorskip("daytona")  # a sandbox extra (make test installs them all)
pytest.importorskip("e2b")  # a sandbox extra (make test installs them all)
pytest.importorskip("modal")  # a sandbox extra (make test installs them all)

import daytona  # noqa: E402
import e2b  # noqa: E402
import modal  # noqa: E402

from verst.sandbox import SandboxError, provider  # noqa: E402
from verst.sandbox.cloud import CloudOptions, OutputSink  # noqa: E402
from verst.sandbox.cloud.daytona import DaytonaOptions, DaytonaProvider  # noqa: E402
from verst.sandbox.cloud.e2b import E2BOptions, E2BProvider  # noqa: E402
from verst.sandbox.cloud.modal import ModalOptions, ModalProvider  # noqa: E402

FILES = {"project.py": "x = 1\n", "tests/test_project.py": "assert True\n"}
SHELL = "/bin/sh -c 'exec 2>&1\n{}'"


# --- Daytona -------------------------------------------------------------------------------------------------

class FakeDaytonaRemote:
    def __init__(self, log: list):
        self.id, self.log = "dt-1", log
        self.fs, self.process = self, self
        self.exec_reply: object = None

    def create_folder(self, path, mode):
        self.log.append(("create_folder", path, mode))

    def upload_files(self, uploads):
        self.log.append(("upload_files", [(u.destination, u.source) for u in uploads]))

    def upload_file(self, data, path):
        self.log.append(("upload_file", path, data))

    def download_file(self, path):
        self.log.append(("download_file", path))
        return b"y = 2\n"

    def exec(self, command, cwd=None, timeout=None):
        self.log.append(("exec", command, cwd, timeout))
        if isinstance(self.exec_reply, Exception):
            raise self.exec_reply
        return self.exec_reply

    def delete(self):
        self.log.append(("delete",))


@pytest.fixture
def fake_daytona(monkeypatch):
    log: list = []
    remote = FakeDaytonaRemote(log)

    class FakeDaytona:
        def __init__(self, config):
            log.append(("client", config.api_key, config.api_url, config.target))

        def create(self, params, timeout):
            log.append(("create", params, timeout))
            return remote

    monkeypatch.setattr(daytona, "Daytona", FakeDaytona)
    monkeypatch.delenv("DAYTONA_API_KEY", raising=False)
    return log, remote


def test_daytona_needs_its_credential_at_construction(fake_daytona):
    with pytest.raises(SandboxError, match="DAYTONA_API_KEY"):
        DaytonaProvider()
    assert fake_daytona[0] == []


def test_daytona_creates_from_an_image_with_resources_and_uploads_the_files(fake_daytona, monkeypatch):
    log, _ = fake_daytona
    monkeypatch.setenv("DAYTONA_API_KEY", "key-from-env")
    options = DaytonaOptions(image="python:3.12-slim", cpu=2, memory_gib=4, disk_gib=8, lifetime_s=600,
                             idle_minutes=5, target="eu")
    sandbox = DaytonaProvider(options).start(FILES)
    assert log[0] == ("client", "key-from-env", None, "eu")
    _, params, timeout = log[1]
    assert isinstance(params, daytona.CreateSandboxFromImageParams)
    assert (params.image, params.resources.cpu, params.resources.memory, params.resources.disk) == (
        "python:3.12-slim", 2, 4, 8)
    assert (params.ephemeral, params.auto_stop_interval, params.ttl_minutes, params.network_block_all) == (
        True, 5, 10, True)
    assert timeout == 120
    assert log[2] == ("create_folder", "/tmp/workspace", "755")
    assert log[3] == ("upload_files", [("/tmp/workspace/project.py", b"x = 1\n"),
                                       ("/tmp/workspace/tests/test_project.py", b"assert True\n")])
    assert sandbox.read_file("/tmp/workspace/b.py") == "y = 2\n"
    sandbox.write_file("sub/c.py", "z\n")
    assert log[4:] == [("download_file", "/tmp/workspace/b.py"), ("upload_file", "/tmp/workspace/sub/c.py", b"z\n")]


def test_daytona_snapshot_refuses_resources_and_is_the_default(fake_daytona):
    log, _ = fake_daytona
    with pytest.raises(SandboxError, match="snapshot"):
        DaytonaProvider(DaytonaOptions(cpu=2), api_key="k")
    with pytest.raises(SandboxError, match="not both"):
        DaytonaProvider(DaytonaOptions(image="python:3.12-slim", snapshot="my-snap"), api_key="k")
    DaytonaProvider(DaytonaOptions(snapshot="my-snap", network=True), api_key="k").start({})
    params = log[1][1]
    assert isinstance(params, daytona.CreateSandboxFromSnapshotParams)
    assert (params.snapshot, params.network_block_all, params.ttl_minutes) == ("my-snap", False, 60)
    assert [entry[0] for entry in log] == ["client", "create", "create_folder"]  # no upload of no files


def test_daytona_exec_maps_exit_codes_timeouts_and_caps_output(fake_daytona):
    log, remote = fake_daytona
    sandbox = DaytonaProvider(DaytonaOptions(output_bytes=8), api_key="k").start({})
    remote.exec_reply = daytona.ExecuteResponse(exit_code=3, result="0123456789")
    result = sandbox.exec("cat a.py; exit 3", timeout_s=2.5)
    assert log[-1] == ("exec", SHELL.format("cat a.py; exit 3"), "/tmp/workspace", 3)
    assert (result.exit_code, result.output, result.timed_out, result.truncated) == (3, "01234567", False, True)
    remote.exec_reply = daytona.DaytonaTimeoutError("Failed to execute command: command execution timeout")
    slow = sandbox.exec("sleep 30", timeout_s=1)
    assert (slow.exit_code, slow.output, slow.timed_out) == (-9, "", True)
    remote.exec_reply = daytona.DaytonaError("Failed to execute command: 502 bad gateway")
    with pytest.raises(SandboxError, match="daytona exec in sandbox dt-1 failed: DaytonaError: .*502"):
        sandbox.exec("true", 1)


def test_daytona_close_deletes_once_and_refuses_further_use(fake_daytona):
    log, _ = fake_daytona
    sandbox = DaytonaProvider(api_key="k").start({})
    sandbox.close()
    sandbox.close()
    assert [entry for entry in log if entry[0] == "delete"] == [("delete",)]
    with pytest.raises(SandboxError, match="dt-1 is closed"):
        sandbox.exec("true", 1)


def test_daytona_a_failed_upload_deletes_the_sandbox(fake_daytona, monkeypatch):
    log, remote = fake_daytona

    def refuse(uploads):
        raise daytona.DaytonaError("Failed to upload files: 507 insufficient storage")

    monkeypatch.setattr(remote, "upload_files", refuse)
    with pytest.raises(SandboxError, match="daytona upload to sandbox dt-1 failed: .*507"):
        DaytonaProvider(api_key="k").start(FILES)
    assert log[-1] == ("delete",)


# --- E2B -----------------------------------------------------------------------------------------------------

class FakeE2BRemote:
    def __init__(self, log: list):
        self.sandbox_id, self.log = "e2b-1", log
        self.files, self.commands = self, self
        self.run_output: list[tuple[str, str]] = []
        self.run_end: object = None

    def make_dir(self, path, request_timeout=None):
        self.log.append(("make_dir", path))

    def write_files(self, entries, request_timeout=None):
        self.log.append(("write_files", [(entry["path"], entry["data"]) for entry in entries]))

    def write(self, path, data, request_timeout=None):
        self.log.append(("write", path, data))

    def read(self, path, request_timeout=None):
        self.log.append(("read", path))
        return "y = 2\n"

    def run(self, cmd, cwd=None, timeout=None, on_stdout=None, on_stderr=None, request_timeout=None):
        self.log.append(("run", cmd, cwd, timeout))
        for stream, text in self.run_output:
            (on_stdout if stream == "stdout" else on_stderr)(text)
        if isinstance(self.run_end, Exception):
            raise self.run_end
        return self.run_end

    def kill(self, request_timeout=None):
        self.log.append(("kill",))


@pytest.fixture
def fake_e2b(monkeypatch):
    log: list = []
    remote = FakeE2BRemote(log)

    def create(**kwargs):
        log.append(("create", kwargs))
        return remote

    monkeypatch.setattr(e2b.Sandbox, "create", create)
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    return log, remote


def test_e2b_needs_its_credential_at_construction(fake_e2b):
    with pytest.raises(SandboxError, match="E2B_API_KEY"):
        E2BProvider()


def test_e2b_creates_from_the_template_and_uploads_the_files(fake_e2b):
    log, _ = fake_e2b
    sandbox = E2BProvider(E2BOptions(template="my-template", lifetime_s=900), api_key="e2b-key").start(FILES)
    assert log[0] == ("create", {"template": "my-template", "timeout": 900, "metadata": {"created-by": "verst"},
                                 "allow_internet_access": False, "api_key": "e2b-key", "domain": None,
                                 "request_timeout": 60})
    assert log[1:] == [("make_dir", "/tmp/workspace"),
                       ("write_files", [("/tmp/workspace/project.py", "x = 1\n"),
                                        ("/tmp/workspace/tests/test_project.py", "assert True\n")])]
    assert sandbox.read_file("b.py") == "y = 2\n"
    sandbox.write_file("/tmp/workspace/c.py", "z\n")
    assert log[3:] == [("read", "/tmp/workspace/b.py"), ("write", "/tmp/workspace/c.py", "z\n")]
    with pytest.raises(SandboxError, match="outside the workspace"):
        sandbox.read_file("../etc/passwd")


def test_e2b_exec_maps_exit_codes_timeouts_and_caps_output(fake_e2b):
    log, remote = fake_e2b
    sandbox = E2BProvider(E2BOptions(output_bytes=10), api_key="k").start({})
    remote.run_output = [("stdout", "out\n"), ("stderr", "err\n")]
    remote.run_end = e2b.CommandResult(stdout="out\n", stderr="err\n", exit_code=0, error=None)
    ok = sandbox.exec("echo out; echo err >&2", timeout_s=7.5)
    assert log[-1] == ("run", SHELL.format("echo out; echo err >&2"), "/tmp/workspace", 7.5)
    assert (ok.exit_code, ok.output, ok.timed_out, ok.truncated) == (0, "out\nerr\n", False, False)
    remote.run_output = [("stdout", "0123456789abc")]
    remote.run_end = e2b.CommandExitException(stdout="0123456789abc", stderr="", exit_code=2, error="exit 2")
    failed = sandbox.exec("false", 5)
    assert (failed.exit_code, failed.output, failed.truncated) == (2, "0123456789", True)
    remote.run_output = [("stdout", "started\n")]
    remote.run_end = e2b.TimeoutException("context deadline exceeded")
    slow = sandbox.exec("echo started; sleep 30", 1)
    assert (slow.exit_code, slow.output, slow.timed_out) == (-9, "started\n", True)
    remote.run_output, remote.run_end = [], e2b.SandboxException("sandbox e2b-1 is not running")
    with pytest.raises(SandboxError, match="e2b exec in sandbox e2b-1 failed: SandboxException: .*not running"):
        sandbox.exec("true", 1)


def test_e2b_create_errors_name_the_operation_and_close_kills_once(fake_e2b, monkeypatch):
    log, _ = fake_e2b
    provider_ = E2BProvider(api_key="k")
    sandbox = provider_.start({})
    sandbox.close()
    sandbox.close()
    assert log.count(("kill",)) == 1

    def refuse(**kwargs):
        raise e2b.AuthenticationException("Invalid API key")

    monkeypatch.setattr(e2b.Sandbox, "create", refuse)
    with pytest.raises(SandboxError, match="e2b create failed: AuthenticationException: Invalid API key"):
        provider_.start({})


# --- Modal ---------------------------------------------------------------------------------------------------

class FakeModalProcess:
    def __init__(self, chunks, code):
        self.stdout, self.code = chunks, code

    def wait(self):
        return self.code


class FakeModalRemote:
    def __init__(self, log: list):
        self.object_id, self.log = "sb-1", log
        self.filesystem = self
        self.process = FakeModalProcess([], 0)

    def make_directory(self, path):
        self.log.append(("make_directory", path))

    def write_text(self, data, path):
        self.log.append(("write_text", path, data))

    def read_text(self, path):
        self.log.append(("read_text", path))
        return "y = 2\n"

    def exec(self, *args, workdir=None, timeout=None):
        self.log.append(("exec", args, workdir, timeout))
        if isinstance(self.process, Exception):
            raise self.process
        return self.process

    def terminate(self):
        self.log.append(("terminate",))


@pytest.fixture
def fake_modal(monkeypatch):
    log: list = []
    remote = FakeModalRemote(log)

    def lookup(name, create_if_missing=False, client=None):
        log.append(("lookup", name, create_if_missing))
        return "app-object"

    def create(**kwargs):
        log.append(("create", kwargs))
        return remote

    monkeypatch.setattr(modal.App, "lookup", lookup)
    monkeypatch.setattr(modal.Sandbox, "create", create)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-test")
    return log, remote


def test_modal_needs_its_credentials_at_construction(fake_modal, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_SECRET")
    monkeypatch.setattr(modal.config.config, "get", lambda key: "ak-test" if key == "token_id" else None)
    with pytest.raises(SandboxError, match="MODAL_TOKEN_SECRET"):
        ModalProvider()
    with pytest.raises(SandboxError, match="together"):
        ModalProvider(token_id="ak-only")


def test_modal_creates_with_image_and_resources_and_uploads_the_files(fake_modal):
    log, _ = fake_modal
    options = ModalOptions(image="python:3.12-slim", cpu=2.0, memory_mib=2048, lifetime_s=1200, idle_timeout_s=60)
    sandbox = ModalProvider(options).start(FILES)
    assert log[0] == ("lookup", "verst-sandboxes", True)
    kwargs = log[1][1]
    assert isinstance(kwargs.pop("image"), modal.Image)
    assert kwargs == {"app": "app-object", "cpu": 2.0, "memory": 2048, "timeout": 1200, "idle_timeout": 60,
                      "workdir": "/tmp/workspace", "block_network": True, "tags": {"created-by": "verst"},
                      "client": None}
    assert log[2:] == [("make_directory", "/tmp/workspace"),
                       ("write_text", "/tmp/workspace/project.py", "x = 1\n"),
                       ("write_text", "/tmp/workspace/tests/test_project.py", "assert True\n")]
    assert sandbox.read_file("b.py") == "y = 2\n"
    assert log[-1] == ("read_text", "/tmp/workspace/b.py")


def test_modal_exec_maps_exit_codes_timeouts_and_caps_output(fake_modal):
    log, remote = fake_modal
    sandbox = ModalProvider(ModalOptions(output_bytes=6)).start({})
    remote.process = FakeModalProcess(["abc", "def", "ghi"], 4)
    result = sandbox.exec("exit 4", timeout_s=0.2)
    assert log[-1] == ("exec", ("/bin/sh", "-c", "exec 2>&1\nexit 4"), "/tmp/workspace", 1)
    assert (result.exit_code, result.output, result.timed_out, result.truncated) == (4, "abcdef", False, True)
    remote.process = FakeModalProcess(["partial"], -1)
    slow = sandbox.exec("sleep 30", timeout_s=2)
    assert (slow.exit_code, slow.timed_out) == (-9, True)
    remote.process = modal.exception.SandboxTerminatedError("Sandbox sb-1 has been terminated")
    with pytest.raises(SandboxError, match="modal exec in sandbox sb-1 failed: SandboxTerminatedError"):
        sandbox.exec("true", 1)
    sandbox.close()
    sandbox.close()
    assert log.count(("terminate",)) == 1


# --- shared --------------------------------------------------------------------------------------------------

def test_provider_selects_by_name_and_refuses_unknown_names(fake_e2b):
    chosen = provider("e2b", options=E2BOptions(template="t"), api_key="k")
    assert isinstance(chosen, E2BProvider) and chosen.options.template == "t"
    with pytest.raises(ValueError, match="'modl' is not registered; registered: local, daytona, e2b, modal"):
        provider("modl")


def test_output_sink_keeps_bytes_not_characters():
    sink = OutputSink(cap=3)
    sink.add("é")  # two bytes
    sink.add("éé")
    result = sink.result(0)
    assert result.truncated and result.output.encode()[:2] == "é".encode()
    assert CloudOptions().remote_path("a/b.py") == "/tmp/workspace/a/b.py"
