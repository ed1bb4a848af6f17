"""The engine's weight routes: loads from disk, from tensors (SGLang's format) and from a process-group
broadcast, the group's lifecycle, the weight version, and LoRA adapters by name, as FastAPI routes over a runner that calls its
core on the engine's thread (the text engine's `EngineRunner`, the diffusion engine's `ImageRunner`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from verst.engine import weight_group
from verst.engine.schema import PEER_RESPONSES
from verst.engine.service import ServerState, error_response
from verst.engine.weights import iter_safetensors, safetensors_files, safetensors_shapes
from verst.inference_client import weights
from verst.inference_client.protocol import WEIGHT_UPDATE_ABORT, InvalidRequest
from verst.inference_client.tensor_payload import deserialize_named_tensors
from verst.inference_client.weight_protocol import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
)

T = TypeVar("T")


class WeightCore(Protocol):
    """What the weight routes ask of an engine's core (on its thread, through `WeightServer.runner`). A core
    that serves no LoRA adapters refuses `build_lora` and `loras.check_room` naming `lora_name`."""

    weight_version: str
    loras: Any  # check_room(name) before a pushed adapter's broadcast

    def abort_all(self, message: str) -> int: ...
    def check_weights(self, named_shapes: list[tuple[str, Any]]) -> dict[str, Any]: ...
    def load_weights(self, named: Iterable[tuple[str, Any]], version: str | None, flush: bool = True,
                     shapes: list[tuple[str, Any]] | None = None) -> int: ...
    def build_lora(self, name: str, config: dict[str, Any], tensors: dict[str, Any]) -> Any: ...
    def add_lora(self, adapter: Any, update_in_flight: bool = False) -> None: ...


class CoreRunner(Protocol):
    async def acall(self, fn: Callable[[Any], T]) -> T: ...


class WeightServer(Protocol):
    """What the weight routes ask of a server: its core, the runner that calls it, the joined groups."""

    weight_groups: dict[str, Any]

    @property
    def core(self) -> WeightCore: ...
    @property
    def runner(self) -> CoreRunner: ...
    @property
    def on_cuda(self) -> bool: ...


def add_weight_routes(app: FastAPI, state: WeightServer) -> None:
    async def load(named, version: str | None, flush: bool, abort_all: bool, shapes=None) -> dict[str, Any]:
        def apply(core):
            if abort_all:
                core.abort_all(WEIGHT_UPDATE_ABORT)
            return core.load_weights(named, version, flush=flush, shapes=shapes)

        n = await state.runner.acall(apply)
        return {"success": True, "message": f"Loaded {n} tensors.", "weight_version": state.core.weight_version,
                "num_paused_requests": 0}

    async def load_adapter(body: Any, named: list[tuple[str, Any]]) -> dict[str, Any]:
        """The pushed tensors are a whole adapter (`AdapterPush`): served under `lora_name`; requests in flight
        on the adapter it replaces go on with it. The base weights are not touched."""
        adapter = await asyncio.to_thread(state.core.build_lora, body.lora_name, body.lora_config, dict(named))

        def apply(core):
            if body.abort_all_requests:
                core.abort_all(WEIGHT_UPDATE_ABORT)
            core.add_lora(adapter, update_in_flight=True)
            if body.weight_version is not None:
                core.weight_version = body.weight_version

        await state.runner.acall(apply)
        return {"success": True, "message": f"Loaded adapter {body.lora_name!r} ({len(named)} tensors).",
                "weight_version": state.core.weight_version, "num_paused_requests": 0}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> dict[str, Any]:
        files = safetensors_files(body.model_path)
        shapes = await asyncio.to_thread(safetensors_shapes, files)
        # read a file at a time on the engine thread, straight from its mapping into the parameters
        return await load(iter_safetensors(files), body.weight_version, True, body.abort_all_requests, shapes)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest) -> Response:
        # views of the sender's shared memory or device memory: no copy here (`param.copy_(view)` in the load)
        named = deserialize_named_tensors(body.serialized_named_tensors[0])
        if body.lora_name is not None:
            return JSONResponse(await load_adapter(body, named))
        return JSONResponse(await load(named, body.weight_version, body.flush_cache, body.abort_all_requests))

    @app.post("/init_weights_update_group", responses=PEER_RESPONSES)
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> Response:
        if body.group_name in state.weight_groups:
            return error_response(400, "a weight update group with this name exists", "group_name", body.group_name)
        if body.backend == "nccl" and not state.on_cuda:
            return error_response(400, "nccl needs the engine on a CUDA device; use gloo", "backend", body.backend)
        group = await weight_group.join(body)
        if isinstance(group, Response):
            return group
        for joined in state.weight_groups.values():
            joined.flat.release()  # a trainer rebuilds its group after a failure: keep one bucket buffer, not one each
        state.weight_groups[body.group_name] = group
        return JSONResponse({"success": True, "message": f"Joined {body.group_name!r} as rank {body.rank_offset}."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest) -> Response:
        group = state.weight_groups.get(body.group_name)
        if group is None:
            return error_response(400, "no such weight update group; call /init_weights_update_group first",
                                  "group_name", body.group_name)
        for dtype in body.dtypes:
            weights.dtype_of(dtype)
        flat = body.load_format == weights.FLATTENED
        if flat and weights.one_dtype(body.dtypes) is None:
            return error_response(400, f"a {weights.FLATTENED} holds tensors of one dtype", "dtypes",
                                  sorted(set(body.dtypes)))
        # refuse before the broadcast starts: a bad name found after it would waste the whole transfer
        if body.lora_name is None:
            state.core.check_weights(list(zip(body.names, body.shapes)))
        else:
            state.core.loras.check_room(body.lora_name)
        receive = weights.receive_flat if flat else weights.receive_broadcast
        named = await asyncio.to_thread(receive, group, body.names, body.dtypes, body.shapes)
        if body.lora_name is not None:
            return JSONResponse(await load_adapter(body, named))
        return JSONResponse(await load(named, body.weight_version, body.flush_cache, body.abort_all_requests))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest | None = None) -> dict[str, Any]:
        name = (body or DestroyWeightsUpdateGroupRequest()).group_name
        state.weight_groups.pop(name, None)
        return {"success": True, "message": f"Left {name!r}."}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": state.core.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> dict[str, Any]:
        def apply(core: WeightCore) -> None:
            if body.abort_all_requests:
                core.abort_all(WEIGHT_UPDATE_ABORT)
            core.weight_version = body.new_version

        await state.runner.acall(apply)
        return {"success": True, "weight_version": body.new_version}


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    """SGLang's dynamic LoRA loading. Loading under a loaded name replaces that adapter: new requests get
    the new weights, requests in flight finish on the ones they started with."""

    async def update(load: Any) -> Response:
        """SGLang's LoRAUpdateOutput: success, error_message and the loaded adapters (name: path)."""
        try:
            await load()
        except InvalidRequest as exc:
            return error_response(400, str(exc), exc.field, exc.value, error_message=str(exc),
                                  loaded_adapters=state.core.loras.paths())
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": state.core.loras.paths()})

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        async def load() -> None:
            adapter = await asyncio.to_thread(state.core.read_lora, body.lora_name, body.lora_path)
            await state.runner.acall(lambda core: core.add_lora(adapter, body.update_in_flight))

        return await update(load)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        return await update(lambda: state.runner.acall(lambda core: core.unload_lora(body.lora_name)))
