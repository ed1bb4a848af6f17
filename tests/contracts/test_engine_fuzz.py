"""Property-based fuzzing of the engine's published OpenAPI (schemathesis): no input gets a 5xx or goes
unanswered, answers match the documented statuses, content types and shapes, and the engine serves after.

Positive cases (bodies the schema allows) may be refused only with a 400 (the engine's state: unknown
adapter, missing file, no weight group) or with a 422 from a cross-field rule the schema cannot state
(equal list lengths, min_new_tokens <= max_new_tokens); never for a field's type, range or presence.
Negative cases must get a 4xx. `init_weights_update_group` is left out: each call dials the generated
address and waits out its timeout; its failure path has its own test in test_engine_api.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

from verst.engine.core import EngineConfig, EngineCore  # noqa: E402
from verst.engine.process import BackgroundServer  # noqa: E402
from verst.models.loader import load_model_and_tokenizer  # noqa: E402

torch.set_num_threads(1)
CHECKS = [
    not_a_server_error, openapi_checks.status_code_conformance, openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance, openapi_checks.negative_data_rejection,
]
NOT_FUZZED = {"POST /init_weights_update_group"}
REQUEST_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=8, context_length=128))
    with BackgroundServer(core, served_model_name="tiny", model_path=str(tiny_model_dir)) as server:
        yield server


@dataclass
class Findings:
    """The first failing case of each distinct failure, across all operations and both modes."""

    failures: dict[str, str] = field(default_factory=dict)
    cases: int = 0

    def add(self, label: str, message: str) -> None:
        title = next((line.strip() for line in message.splitlines() if line.strip().startswith(("-", "POS"))), "")
        self.failures.setdefault(f"{label}: {title or message[:120]}", message[:3000])


def positive_refusal_problem(response: httpx.Response | object) -> str | None:
    """Why a schema-valid body's answer breaks the contract, or None."""
    status = response.status_code
    if status < 300 or status == 400:
        return None
    if status == 422:
        detail = response.json().get("detail", [])
        if detail and all(error["type"] == "value_error" for error in detail):
            return None  # a cross-field rule (a model validator), which JSON Schema cannot state
    return f"POS{status}: a schema-valid body was refused: {response.text[:600]}"


def fuzz(engine: BackgroundServer, examples: int, budget_s: float) -> Findings:
    schema = schemathesis.openapi.from_url(f"{engine.url}/openapi.json")
    findings, deadline = Findings(), time.monotonic() + budget_s
    with httpx.Client(base_url=engine.url, timeout=REQUEST_TIMEOUT_S) as http:
        for result in schema.get_all_operations():
            operation = result.ok()
            label = f"{operation.method.upper()} {operation.path}"
            if label in NOT_FUZZED:
                continue
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if time.monotonic() > deadline:
                    findings.add("budget", f"the {budget_s:g}s budget ran out before {label} ({mode.value})")
                    return findings
                run_operation(engine, http, operation, mode, examples, findings, f"{label} [{mode.value}]")
    return findings


def run_operation(engine, http, operation, mode, examples, findings, label) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        findings.cases += 1
        try:
            response = case.call_and_validate(base_url=engine.url, checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
            problem = positive_refusal_problem(response) if mode is GenerationMode.POSITIVE else None
            if problem:
                findings.add(label, f"{problem}\nbody: {case.body!r}"[:3000])
        except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - every failure is collected and reported
            findings.add(label, str(exc))
        finally:
            if operation.path == "/pause_generation":
                http.post("/continue_generation")

    try:
        check()
    except Unsatisfiable:
        pass  # an operation without parameters or body has no negative cases


def assert_engine_serves(engine: BackgroundServer) -> None:
    with httpx.Client(base_url=engine.url, timeout=REQUEST_TIMEOUT_S) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        reply = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True, "temperature": 0}})
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["output_ids"]) == 4


def report(findings: Findings) -> str:
    return "\n\n".join(f"== {key}\n{message}" for key, message in findings.failures.items())


def test_fuzzed_openapi_gets_no_5xx_and_the_engine_serves_after(engine):
    findings = fuzz(engine, examples=8, budget_s=90)
    assert not findings.failures, report(findings)
    assert findings.cases > 100
    assert_engine_serves(engine)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzzed_openapi_at_length(engine):
    findings = fuzz(engine, examples=150, budget_s=1200)
    assert not findings.failures, report(findings)
    assert_engine_serves(engine)
