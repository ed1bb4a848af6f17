"""The engine's published OpenAPI document: built from the pydantic models the handlers validate with, plus
the served model's limits (vocabulary, context length), so the schema is the contract a client can rely on.

Statuses: 400 is a well-formed request refused by the engine's state (model, adapters, groups, files),
422 a body that does not match the schema, 502/504 a peer that failed or did not answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from verst.inference_client.protocol import BatchGenerateRequest, GenerateRequest

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    code: int
    field: str | None = None
    value: Any = None


class ErrorReply(BaseModel):
    """SGLang's error body `{"error": {...}}` with the refused field and value; LoRA routes add
    `error_message` and `loaded_adapters`, 422 adds pydantic's `detail` list."""

    model_config = ConfigDict(extra="allow")

    error: ErrorDetail
    success: bool
    message: str


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorReply, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("Refused by the engine's state (model, adapters, weight groups, files); names the field."),
    422: _error("The body does not match this schema; names the field."),
}
PEER_RESPONSES: dict[int | str, dict[str, Any]] = {
    502: _error("The peer named by master_address failed to join."),
    504: _error("The peer named by master_address did not answer within timeout_s."),
}
UNHEALTHY: dict[int | str, dict[str, Any]] = {
    200: {"description": "Healthy (empty body).", "content": {}},
    503: _error("The engine thread stopped or the model's probe failed."),
}


def install_openapi(app: FastAPI, vocab_size: int, context_length: int) -> None:
    """Replace `app.openapi` with the engine's document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description=__doc__.split("\n\n", 1)[1].strip())
            _add_generate_body(doc)
            _bound_token_ids(doc, vocab_size, context_length)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_generate_body(doc: dict[str, Any]) -> None:
    """/generate reads its raw body to tell one prompt from a batch; its schema is the union of both."""
    refs, defs = models_json_schema([(GenerateRequest, "validation"), (BatchGenerateRequest, "validation")],
                                    ref_template=REF)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    body = {"anyOf": [refs[(GenerateRequest, "validation")], refs[(BatchGenerateRequest, "validation")]]}
    operation = doc["paths"]["/generate"]["post"]
    operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    operation["responses"]["200"] = {
        "description": "One reply (a list of replies for a batch); with stream = true, server-sent events of "
                       "cumulative replies ending in `data: [DONE]`.",
        "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": {
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}},
    }


def _bound_token_ids(node: Any, vocab_size: int, context_length: int) -> None:
    """Token-id lists (marked `x-token-ids` by `verst.inference_client.protocol.TokenIds`) get the model's
    vocabulary as item bounds; prompts also a length the context holds."""
    if isinstance(node, dict):
        kind = node.get("x-token-ids")
        if kind is not None:
            node["items"] = {**node.get("items", {}), "minimum": 0, "maximum": vocab_size - 1}
            if kind == "prompt":
                node.update(minItems=1, maxItems=context_length - 1)
        for value in node.values():
            _bound_token_ids(value, vocab_size, context_length)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size, context_length)
