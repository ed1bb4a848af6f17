"""The rules of the engines and the weight sync (`cluster.engine`, its flag tables, `sync.transport`, LoRA's
loading): part of `verst.config.rules.RULES`. Each reads the engine kinds' and transports' registry traits.
"""

from __future__ import annotations

from typing import Any

from verst.config.devices import on_cuda
from verst.config.engine_flags import flag_argv
from verst.config.inputs import ModelConfig
from verst.config.registries import ENGINE_KINDS, WEIGHT_TRANSPORTS
from verst.config.runtime import ClusterConfig, SyncConfig
from verst.config.training import LoraConfig


def engine_takes_the_transport(cluster: ClusterConfig, sync: SyncConfig) -> None:
    engine = ENGINE_KINDS.entry(cluster.engine)
    if sync.transport not in engine.transports:
        raise ValueError(f"sync.transport = {sync.transport!r} is not supported with cluster.engine = "
                         f"{cluster.engine!r}{': ' + engine.transport_note if engine.transport_note else ''}; use one "
                         f"of {list(engine.transports)}")


def colocated_engines_release_memory(cluster: ClusterConfig, vllm: dict[str, Any], sglang: dict[str, Any]) -> None:
    """Colocated, the engines give their memory to the trainer around each step; some need a flag for it."""
    entry = ENGINE_KINDS.entry(cluster.engine)
    flag, table = entry.memory_flag, entry.flags_table
    if cluster.placement == "colocated" and flag and not flag_given({"vllm": vllm, "sglang": sglang}, table, flag):
        raise ValueError(f"cluster.placement = 'colocated' with cluster.engine = {cluster.engine!r} needs "
                         f"{table}.{flag} = true: verst has the engines release their device memory around each train "
                         f"step, which {cluster.engine} does only with that flag; or use cluster.placement = "
                         "'disaggregated'")


def engine_loads_lora(cluster: ClusterConfig, lora: LoraConfig, vllm: dict[str, Any],
                      sglang: dict[str, Any]) -> None:
    if not lora.enabled:
        return
    entry = ENGINE_KINDS.entry(cluster.engine)
    if not entry.lora:
        raise ValueError(f"lora.enabled = true is not supported with cluster.engine = {cluster.engine!r} (verst does "
                         f"not load adapters into it); use cluster.engine = {engines_with('lora')}")
    if entry.lora_flag and not flag_given({"vllm": vllm, "sglang": sglang}, entry.flags_table, entry.lora_flag):
        raise ValueError(f"lora.enabled = true with cluster.engine = {cluster.engine!r} needs "
                         f"{entry.flags_table}.{entry.lora_flag} = true ({cluster.engine} loads adapters only with LoRA "
                         "enabled at start-up)")


def adapter_tensors_need_an_engine_that_loads_them(cluster: ClusterConfig, sync: SyncConfig,
                                                   lora: LoraConfig) -> None:
    by_file = WEIGHT_TRANSPORTS.entry(sync.transport).keeps_snapshots
    if lora.served_adapter and not by_file and not ENGINE_KINDS.entry(cluster.engine).adapter_tensors:
        raise ValueError(f"lora.sync = 'adapter' with sync.transport = {sync.transport!r}: cluster.engine = "
                         f"{cluster.engine!r} does not load an adapter from pushed tensors (only "
                         f"{engines_with('adapter_tensors')} does); use sync.transport = 'disk' (an adapter directory "
                         "loaded with /load_lora_adapter) or lora.sync = 'merged'")


def model_impl_is_the_embedded_engines(model: ModelConfig, cluster: ClusterConfig) -> None:
    if model.impl != "auto" and not ENGINE_KINDS.entry(cluster.engine).model_impl:
        raise ValueError(f"model.impl = {model.impl!r} chooses the embedded engine's model class; cluster.engine = "
                         f"{cluster.engine!r} runs its own (leave model.impl = 'auto')")


def engine_flags_go_to_their_engine(cluster: ClusterConfig, vllm: dict[str, Any], sglang: dict[str, Any]) -> None:
    own = ENGINE_KINDS.entry(cluster.engine)
    for table, values in {"vllm": vllm, "sglang": sglang}.items():
        if values and table != own.flags_table:
            raise ValueError(f"[{table}] flags ({', '.join(values)}) are given, but cluster.engine = "
                             f"{cluster.engine!r}; they pass to a {table} server only")
        for name in values:
            if name.replace("_", "-") in own.owned_flags:
                raise ValueError(f"{table}.{name}: verst sets --{name} itself (model.path, model.dtype, a free port on "
                                 "the engine's node); leave it out")
        flag_argv(table, values)


def colocated_broadcast_needs_a_gpu_each(cluster: ClusterConfig, sync: SyncConfig) -> None:
    """Colocated on CUDA, a trainer rank and its engine share one GPU, and NCCL refuses two ranks of one group
    on one device: a broadcast's group cannot form."""
    if cluster.placement != "colocated" or WEIGHT_TRANSPORTS.entry(sync.transport).one_gpu:
        return
    if on_cuda(cluster.device):
        others = " or ".join(repr(name) for name in WEIGHT_TRANSPORTS if WEIGHT_TRANSPORTS.entry(name).one_gpu)
        raise ValueError(f"sync.transport = {sync.transport!r} with cluster.placement = 'colocated' on cluster.device = "
                         f"{cluster.device!r} (CUDA): the trainer and an engine share a GPU, and NCCL refuses two ranks "
                         f"of one group on one GPU; use sync.transport = {others}")


def cuda_ipc_needs_an_engine_that_takes_it(cluster: ClusterConfig, sync: SyncConfig) -> None:
    """On CUDA the tensor transport hands the engines CUDA-IPC handles (SGLang's scheme)."""
    same_machine = WEIGHT_TRANSPORTS.entry(sync.transport).same_machine
    if same_machine and on_cuda(cluster.device) and not ENGINE_KINDS.entry(cluster.engine).cuda_ipc:
        raise ValueError(f"sync.transport = {sync.transport!r} with cluster.engine = {cluster.engine!r} on "
                         f"cluster.device = {cluster.device!r} (CUDA): on CUDA the transport hands the engines CUDA-IPC "
                         f"handles, which cluster.engine = {cluster.engine!r} does not take; use sync.transport = "
                         "'distributed' (an NCCL broadcast) or 'disk'")


ENGINE_RULES = (
    engine_takes_the_transport, colocated_engines_release_memory, engine_loads_lora,
    adapter_tensors_need_an_engine_that_loads_them, model_impl_is_the_embedded_engines, engine_flags_go_to_their_engine,
    colocated_broadcast_needs_a_gpu_each, cuda_ipc_needs_an_engine_that_takes_it,
)


def flag_given(tables: dict[str, dict[str, Any]], table: str | None, name: str) -> bool:
    """Whether the pass-through `table` sets the bare flag `name` (dashes or underscores)."""
    values = tables.get(table or "", {})
    return any(key.replace("_", "-") == name and value is True for key, value in values.items())


def engines_with(trait: str) -> str:
    """The engine kinds with `trait`, for a message: 'verst' or 'sglang'."""
    return " or ".join(repr(name) for name in ENGINE_KINDS if getattr(ENGINE_KINDS.entry(name), trait))
