"""The HTTP routes of one simulated engine, in SGLang's native dialect as docs/engine-api.md states it:
/generate (token ids, logprobs, meta_info), the weight-version, pause, continue, flush and abort routes, the
three weight-load routes, and /health. A body that breaks the schema is a 422 naming the field; what the
engine's state refuses is a 400. `SimFaults` are what the fleet's control turns on: refused loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
from typing import Any

from verst.inference_client.protocol import MAX_SAMPLES_PER_REQUEST, WEIGHT_UPDATE_ABORT, sample_rid
from verst.sim.engine import EngineRefused, SimEngine
from verst.sim.http import Handler, error

ROUTING_KEY_HEADER = "x-smg-routing-key"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1, "int32": 4, "int64": 8}
_rids = itertools.count()


@dataclasses.dataclass
class SimFaults:
    """Faults an engine is put into by the fleet's control."""

    refuse_loads: bool = False


def _field(body: dict[str, Any] | None, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if not isinstance(body, dict):
        raise _Invalid("the body must be a JSON object", None)
    if name not in body or body[name] is None:
        if default is ...:
            raise _Invalid(f"{name} is required", name)
        return default
    value = body[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise _Invalid(f"{name} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}", name)
    return value


class _Invalid(ValueError):
    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


def engine_routes(engine_of: Any, model_path: str, vocab_size: int, faults: SimFaults) -> dict[str, Handler]:
    """The handlers of the engine `engine_of()` returns (the fleet swaps it on a restart)."""

    def guarded(fn: Any) -> Handler:
        async def handle(body: dict[str, Any] | None, headers: dict[str, str]) -> tuple[int, Any]:
            try:
                return await fn(engine_of(), body, headers)
            except _Invalid as exc:
                return error(422, str(exc), exc.field)
            except EngineRefused as exc:
                return error(400, str(exc), exc.field)
        return handle

    async def generate(engine: SimEngine, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
        ids = _field(body, "input_ids", list)
        params = _field(body, "sampling_params", dict, {})
        logprob = _field(body, "return_logprob", bool, False)
        rid = _field(body, "rid", (str, list), None)
        key = headers.get(ROUTING_KEY_HEADER)
        n = _field(params, "n", int, 1)
        if ids and isinstance(ids[0], list):  # SGLang's batch form: one reply per prompt
            if n != 1:
                raise _Invalid(f"sampling_params.n = {n} is for a single prompt, not a batch of {len(ids)}", "n")
            rids = rid if isinstance(rid, list) else [f"sim-{next(_rids)}" for _ in ids]
            return 200, [await engine.generate(one, params, r, logprob, key) for one, r in zip(ids, rids)]
        if isinstance(rid, list):
            raise _Invalid("rid is a list for a single prompt; give one rid", "rid")
        rid = rid or f"sim-{next(_rids)}"
        if n == 1:
            return 200, await engine.generate(ids, params, rid, logprob, key)
        if not 1 <= n <= MAX_SAMPLES_PER_REQUEST:
            raise _Invalid(f"sampling_params.n = {n} must be in [1, {MAX_SAMPLES_PER_REQUEST}]", "n")
        # Parallel sampling as verst's engines serve it: sample i is `{rid}_{i}`, seeded seed + i.
        seed = engine.outputs.seed_of(ids, params)
        return 200, list(await asyncio.gather(*(
            engine.generate(ids, {**params, "n": 1, "sampling_seed": seed + i}, sample_rid(rid, i), logprob, key)
            for i in range(n))))

    async def load(engine: SimEngine, nbytes: float, body: Any) -> tuple[int, Any]:
        if faults.refuse_loads:
            return error(500, f"engine {engine.index} refuses weight loads (a simulated fault)")
        version = _field(body, "weight_version", str, None)
        await engine.load(nbytes, version, _field(body, "flush_cache", bool, True))
        return 200, {"success": True, "message": "loaded", "weight_version": engine.weight_version}

    async def from_distributed(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        shapes, dtypes = _field(body, "shapes", list), _field(body, "dtypes", list)
        if len(shapes) != len(dtypes) or len(shapes) != len(_field(body, "names", list)):
            raise _Invalid(f"names, dtypes and shapes differ in length ({len(shapes)} shapes, {len(dtypes)} dtypes)",
                           "shapes")
        unknown = sorted({d for d in dtypes if d not in DTYPE_BYTES})
        if unknown:
            raise _Invalid(f"dtypes {unknown} are not among {sorted(DTYPE_BYTES)}", "dtypes")
        return await load(engine, sum(math.prod(s) * DTYPE_BYTES[d] for s, d in zip(shapes, dtypes)), body)

    async def whole_model(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        return await load(engine, engine.costs.model.weight_bytes, body)

    async def pause(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        mode = _field(body or {}, "mode", str, "retract")
        return 200, {"success": True, "mode": mode, "num_paused_requests": engine.pause(mode)}

    async def resume(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        engine.resume()
        return 200, {"success": True, "message": "Generation continued."}

    async def flush(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        engine.flush()
        return 200, {"success": True, "message": "Cache flushed."}

    async def abort(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        if _field(body, "abort_all", bool, False):
            return 200, {"success": True, "aborted": engine.abort()}
        return 200, {"success": True, "aborted": engine.abort(_field(body, "rid", str))}

    async def set_version(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        version = _field(body, "new_version", str)
        if _field(body, "abort_all_requests", bool, False):
            engine.abort(message=WEIGHT_UPDATE_ABORT)
        engine.weight_version = version
        return 200, {"success": True, "weight_version": version}

    async def version(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        return 200, {"weight_version": engine.weight_version}

    async def ok(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        return 200, b""

    async def joined(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        return 200, {"success": True, "message": "joined (simulated)"}

    async def model_info(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        return 200, {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True,
                     "vocab_size": vocab_size, "weight_version": engine.weight_version}

    async def server_info(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        stats = engine.stats()
        return 200, {"engine": "verst-sim", "model_path": model_path, "max_running_requests": engine.max_running,
                     "dp_size": 1, "tp_size": engine.costs.gpus, "busy_seconds": stats["busy_seconds"],
                     "uptime_seconds": stats["uptime_seconds"], "weight_version": engine.weight_version,
                     "internal_states": [stats]}

    async def load_report(engine: SimEngine, body: Any, _: dict[str, str]) -> tuple[int, Any]:
        return 200, [{"dp_rank": 0, "num_reqs": len(engine.running) + len(engine.waiting),
                      "num_waiting_reqs": len(engine.waiting), "num_tokens": engine.kv_reserved}]

    handlers = {
        "/generate": generate, "/update_weights_from_distributed": from_distributed,
        "/update_weights_from_disk": whole_model, "/update_weights_from_tensor": whole_model,
        "/init_weights_update_group": joined, "/destroy_weights_update_group": joined,
        "/pause_generation": pause, "/continue_generation": resume, "/flush_cache": flush,
        "/abort_request": abort, "/update_weight_version": set_version, "/get_weight_version": version,
        "/health": ok, "/health_generate": ok, "/get_model_info": model_info, "/model_info": model_info,
        "/get_server_info": server_info, "/get_load": load_report,
    }
    return {path: guarded(fn) for path, fn in handlers.items()}
