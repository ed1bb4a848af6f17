"""`EngineAPI`: the one interface the rollout side and the weight syncer use to drive an engine server,
whatever server it is. `EngineClient` speaks it to SGLang-dialect servers; `VLLMAdapter` maps it to vLLM.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineAPI(Protocol):
    """Async calls on one engine. Replies follow SGLang's native dialect (the lingua franca of verst):
    `generate` returns `{"output_ids", "text", "meta_info": {"output_token_logprobs", "finish_reason",
    "weight_version", ...}}`; an aborted request returns normally with finish_reason type "abort"."""

    async def generate(self, input_ids: list[int] | None = None, sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None, return_logprob: bool = True) -> Any:
        """Token ids in, token ids out, with the logprob of each sampled token and the weights' version."""

    async def abort(self, rid: str) -> None:
        """End one request now (it answers with finish_reason "abort")."""

    async def abort_all(self) -> None:
        """End every request in flight."""

    async def pause(self, mode: str = "retract") -> dict[str, Any]:
        """Stop generating (mode: abort, retract or in_place, SGLang's modes) until `continue_generation`."""

    async def continue_generation(self) -> dict[str, Any]:
        """Undo `pause`."""

    async def flush_cache(self) -> dict[str, Any]:
        """Drop the prefix cache (KV computed with the old weights)."""

    async def update_weights_from_disk(self, model_path: str, weight_version: str, **extra: Any) -> dict[str, Any]:
        """Load the weights of the HF checkpoint directory `model_path`."""

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        """Name the weights now served; replies report it."""

    async def get_weight_version(self) -> str:
        """The version of the weights now served."""

    async def get_model_info(self) -> dict[str, Any]:
        """At least `model_path` and `vocab_size`."""

    async def get_load(self) -> list[dict[str, Any]]:
        """Per data-parallel rank: running and queued requests."""

    async def health(self) -> bool:
        """The server is up and serves."""
