"""What comes back from an engine: one `/generate` reply as a `GenerateResult`, and the errors (`EngineError`,
with the server's message and the field it names), read off an HTTP response. Imports no torch."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import httpx
import numpy as np

from verst.inference_client.protocol import WEIGHT_UPDATE_ABORTS

ROUTER_SEND_ERROR = "error sending request for url"  # sglang-router's 500 when an engine cannot be reached


class EngineError(RuntimeError):
    """A non-2xx reply or a transport failure; carries the URL, status, the server's message and field."""

    def __init__(self, url: str, status: int | None, message: str, field: str | None = None):
        super().__init__(f"{url}: {status if status is not None else 'no reply'}: {message}")
        self.url, self.status, self.message = url, status, message
        self.field = field  # the request field the server named as the offending one, if any


class RoutingKeyError(ValueError):
    """A request that needs session affinity was sent without a routing key."""


@dataclasses.dataclass
class GenerateResult:
    """One `/generate` reply: token ids, their logprobs, why it ended, and which weights produced it."""

    rid: str
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # stop | length | abort
    matched: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    text: str
    routed_experts_flat: np.ndarray | None  # int32, [prompt + output - 1, moe_layers * top_k] when asked for
    meta_info: dict[str, Any]

    @property
    def oldest_weight_version(self) -> str:
        """The oldest weights that sampled a token of this reply (a weight update can land while a request
        is paused in place or retracted). verst engines report it; for engines that do not (SGLang) it is
        the reply's `weight_version`, exact only for requests that no update interrupted."""
        return str(self.meta_info.get("oldest_weight_version", self.weight_version))

    @property
    def aborted_for_weight_update(self) -> bool:
        """Whether a weight update ended this call (its output so far is in the reply): the abort's message is
        one an engine gives the requests a weight update aborts (`WEIGHT_UPDATE_ABORTS`)."""
        if self.finish_reason != "abort":
            return False
        return (self.meta_info.get("finish_reason") or {}).get("message") in WEIGHT_UPDATE_ABORTS

    def routed_experts(self, top_k: int) -> np.ndarray | None:
        """`[prompt + output - 1, moe_layers, top_k]` (SGLang's layout), or None when not returned."""
        if self.routed_experts_flat is None:
            return None
        return self.routed_experts_flat.reshape(self.routed_experts_flat.shape[0], -1, top_k)

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> GenerateResult:
        meta = reply["meta_info"]
        finish = meta.get("finish_reason") or {}
        logprobs = meta.get("output_token_logprobs")
        experts = None
        if meta.get("routed_experts"):
            rows = int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1
            flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
            experts = flat.reshape(rows, -1) if rows > 0 else flat.reshape(0, 0)
        return cls(
            rid=str(meta.get("id", "")), output_ids=list(reply["output_ids"]),
            logprobs=[float(item[0]) for item in logprobs] if logprobs is not None else None,
            finish_reason=finish.get("type", "abort"), matched=finish.get("matched"),
            prompt_tokens=int(meta.get("prompt_tokens", 0)), completion_tokens=int(meta.get("completion_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens", 0)), weight_version=str(meta.get("weight_version", "")),
            text=reply.get("text", ""), routed_experts_flat=experts, meta_info=meta,
        )


# What an httpx transport error with no text of its own means (it is named by its type and this).
_TRANSPORT_MEANINGS = {
    "ReadError": "the connection was closed or reset before a reply came",
    "WriteError": "the connection was closed or reset while the request was sent",
    "RemoteProtocolError": "the server closed the connection without a complete reply",
    "ConnectError": "nothing accepted the connection",
}


def transport_error_text(error: BaseException, name: str | None = None) -> str:
    """`ConnectError: All connection attempts failed`, or for an error without text its type and what it
    means (`ReadError (no message: the connection was closed or reset before a reply came)`). `name`: the
    name to give it instead of its type's."""
    name, text = name or type(error).__name__, " ".join(str(error).split())
    if text:
        return f"{name}: {text}"
    return f"{name} (no message: {_TRANSPORT_MEANINGS.get(name, 'the transport failed without a reason')})"


def engine_went_away(error: EngineError) -> bool:
    """A lost connection (not a timeout), or a router's reply that its engine could not be reached
    (sglang-router answers 500 "error sending request for url ...")."""
    if error.status is None:
        return "timed out" not in error.message
    return error.status in (502, 503, 504) or (error.status == 500 and ROUTER_SEND_ERROR in error.message)


def error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)


def error_field(response: httpx.Response) -> str | None:
    """The offending field an error body names (verst engines: `error.field`; OpenAI style: `error.param`)."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    field = error.get("field", error.get("param"))
    return str(field) if field is not None else None


def json_or_raise(response: httpx.Response, url: str) -> Any:
    if response.status_code >= 400:
        raise EngineError(url, response.status_code, error_message(response), error_field(response))
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError:
        return {"text": response.text}
