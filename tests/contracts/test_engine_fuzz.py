"""Property-based fuzzing of the engine's published OpenAPI (schemathesis), every route: no input gets a 5xx or
goes unanswered, answers match the documented statuses, content types and shapes, and the engine serves after.

Positive cases (bodies the schema allows) may be refused only with a 400 (the engine's state: unknown
adapter, missing file, no weight group) or with a 422 from a cross-field rule the schema cannot state
(equal list lengths, min_new_tokens <= max_new_tokens); never for a field's type, range or presence.
Negative cases must get a 4xx.

`init_weights_update_group` dials the master its body names: its positive cases are pointed at a port of
this test's that refuses connections, with a short `timeout_s`, so each gets the engine's 504 naming that
master (the one 5xx a fuzzed request may get) within a second, and no generated address is dialled.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

from verst.engine.process import EngineProcess  # noqa: E402

CONFORMANCE = [
    openapi_checks.status_code_conformance, openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance, openapi_checks.negative_data_rejection,
]
CHECKS = [not_a_server_error, *CONFORMANCE]
JOIN = "POST /init_weights_update_group"
JOIN_TIMEOUT_S = 0.2  # the positive joins' timeout_s: the refusing master is reported after it
REQUEST_TIMEOUT_S = 30.0
EXAMPLES = 30  # per route and mode: enough to reach the absurd values (huge world sizes, garbled hosts)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """In a child process: a fuzzed `/set_cores` pins the engine's process to the cores it names."""
    with EngineProcess(tiny_model_dir, args=["--max-running-requests", "8", "--context-length", "128",
                                             "--served-model-name", "tiny"]) as server:
        yield server


@pytest.fixture(scope="module")
def refusing_master():
    """A loopback port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class Findings:
    """The first failing case of each distinct failure, across all operations and both modes."""

    failures: dict[str, str] = field(default_factory=dict)
    cases: int = 0

    def add(self, label: str, message: str) -> None:
        title = next((line.strip() for line in message.splitlines() if line.strip().startswith(("-", "POS", "5"))), "")
        self.failures.setdefault(f"{label}: {title or message[:120]}", message[:3000])


def positive_refusal_problem(response: httpx.Response) -> str | None:
    """Why a schema-valid body's answer breaks the contract, or None."""
    status = response.status_code
    if status < 300 or status == 400:
        return None
    if status == 422:
        detail = response.json().get("detail", [])
        if detail and all(error["type"] == "value_error" for error in detail):
            return None  # a cross-field rule (a model validator), which JSON Schema cannot state
    return f"POS{status}: a schema-valid body was refused: {response.text[:600]}"


def join_problem(response: httpx.Response, master: str) -> str | None:
    """Why a join's answer is wrong: a 5xx is right only as the 502/504 naming the refusing master."""
    if response.status_code < 500:
        return None
    error = response.json().get("error", {}) if response.status_code in (502, 504) else {}
    if error.get("field") == "master_address" and error.get("value") == master:
        return None
    return f"5xx {response.status_code} not naming the master {master}: {response.text[:600]}"


def at_master(master: str):
    """Point a generated join at `master` with a short timeout; every other field stays as generated."""
    host, port = master.rsplit(":", 1)

    def point(case):
        if isinstance(case.body, dict):
            case.body.update(master_address=host, master_port=int(port), timeout_s=JOIN_TIMEOUT_S)
        return case

    return point


def fuzz(engine: EngineProcess, master: str, examples: int, budget_s: float) -> Findings:
    schema = schemathesis.openapi.from_url(f"{engine.url}/openapi.json")
    findings, deadline = Findings(), time.monotonic() + budget_s
    with httpx.Client(base_url=engine.url, timeout=REQUEST_TIMEOUT_S) as http:
        for result in schema.get_all_operations():
            operation = result.ok()
            label = f"{operation.method.upper()} {operation.path}"
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if time.monotonic() > deadline:
                    findings.add("budget", f"the {budget_s:g}s budget ran out before {label} ({mode.value})")
                    return findings
                run_operation(engine, http, operation, mode, examples, findings, label, master)
    return findings


def run_operation(engine, http, operation, mode, examples, findings, label, master) -> None:
    strategy = operation.as_strategy(generation_mode=mode)
    joins = label == JOIN and mode is GenerationMode.POSITIVE
    if joins:
        strategy = strategy.map(at_master(master))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(case) -> None:
        findings.cases += 1
        try:
            response = case.call_and_validate(base_url=engine.url, checks=CONFORMANCE if joins else CHECKS,
                                              timeout=REQUEST_TIMEOUT_S)
            if joins and response.status_code >= 500:
                problem = join_problem(response, master)
            else:
                problem = positive_refusal_problem(response) if mode is GenerationMode.POSITIVE else None
            if problem:
                findings.add(f"{label} [{mode.value}]", f"{problem}\nbody: {case.body!r}"[:3000])
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - every failure is collected and reported
            findings.add(f"{label} [{mode.value}]", f"{exc}\nbody: {case.body!r}")
        finally:
            if operation.path == "/pause_generation":
                http.post("/continue_generation")

    try:
        check()
    except Unsatisfiable:
        pass  # an operation without parameters or body has no negative cases


def assert_engine_serves(engine: EngineProcess) -> None:
    with httpx.Client(base_url=engine.url, timeout=REQUEST_TIMEOUT_S) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        reply = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True, "temperature": 0}})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["output_ids"]) == 4


def report(findings: Findings) -> str:
    return "\n\n".join(f"== {key}\n{message}" for key, message in findings.failures.items())


def test_fuzzed_openapi_gets_no_5xx_and_the_engine_serves_after(engine, refusing_master):
    findings = fuzz(engine, refusing_master, examples=EXAMPLES, budget_s=300)
    assert not findings.failures, report(findings)
    assert findings.cases > 400
    assert_engine_serves(engine)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzzed_openapi_at_length(engine, refusing_master):
    findings = fuzz(engine, refusing_master, examples=150, budget_s=1200)
    assert not findings.failures, report(findings)
    assert_engine_serves(engine)
