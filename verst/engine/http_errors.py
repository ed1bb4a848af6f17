"""How the engine's HTTP layer reads bodies and answers: bodies parsed and replies encoded by orjson (a reply with
per-token logprobs runs to kilobytes, which the standard library's encoder takes twenty times longer over), and
what it refuses: invalid JSON and schema errors as a 422 naming the most specific field, FastAPI's own errors in
the same body (`service.error_response`).
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from verst.engine.service import error_response


async def json_body(request: Request) -> Any:
    """The parsed JSON body; invalid JSON is answered as FastAPI answers it for a typed body (422)."""
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": str(exc)}}]) from None


def json_response(payload: Any, status_code: int = 200) -> Response:
    """`payload` as a JSON reply."""
    return Response(orjson.dumps(payload), status_code=status_code, media_type="application/json")


def validated(model: type[BaseModel], raw: Any) -> Any:
    """`model` from a raw body; errors answered as for a typed FastAPI body (422 naming the field)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Errors raised inside FastAPI itself (an unreadable body, an unknown route) in the engine's error shape."""
    if exc.status_code < 400:
        return Response(status_code=exc.status_code, headers=exc.headers)
    field = "body" if exc.status_code == 400 else None
    response = error_response(exc.status_code, str(exc.detail), field, None)
    response.headers.update(exc.headers or {})
    return response


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming the first offending field and its value, plus pydantic's full error list."""
    errors = exc.errors()
    first = _most_specific(errors)
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_branch(p)]
    field = ".".join(loc) or "body"
    if first.get("type") == "json_invalid":
        field = "body"
        message = f"body: invalid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})"
        value = None
    else:
        value = first.get("input")
        shown = f"{field} = {value!r}" if "input" in first else field
        message = f"{shown}: {first.get('msg', 'invalid')}"
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in errors]
    response = error_response(422, message, field, value)
    body = json.loads(response.body)
    body["detail"] = detail
    return JSONResponse(body, status_code=422)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _union_branch(part: Any) -> bool:
    """Whether a loc part is pydantic's tag of a union member ('str', 'list[int]'), not a field name."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The first error, or the deepest one about the same field: a union's members each report, and the
    member the value was meant for reports deepest (`prompt.0`, not `prompt` as a string)."""
    if not errors:
        return {}
    field = errors[0].get("loc", ())[:2]
    same = [e for e in errors if e.get("loc", ())[:2] == field]
    return max(same, key=lambda e: len(e.get("loc", ())))
