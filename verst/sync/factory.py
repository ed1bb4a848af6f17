"""`SyncConfig` → a transport and a syncer: the one place that maps `sync.transport` and the device to
an implementation (gloo or NCCL for the broadcast).
"""

from __future__ import annotations

from pathlib import Path

from verst.config.schema import SyncConfig
from verst.inference_client.fleet import EngineFleet
from verst.sync.check import LogprobChecker, LogprobsFn
from verst.sync.disk import DiskTransport
from verst.sync.distributed import DistributedTransport
from verst.sync.syncer import WeightSyncer
from verst.sync.tensor import TensorTransport
from verst.sync.transport import AdapterSpec, WeightTransport


def build_transport(
    cfg: SyncConfig, fleet: EngineFleet, *, device: str = "cpu", snapshot_dir: str | Path | None = None,
    keep_snapshots: int = 2, source_model: str | Path | None = None, master_address: str = "127.0.0.1",
    timeout_s: float = 60.0, adapter: AdapterSpec | None = None,
) -> WeightTransport:
    """`device` is where the trainer's full weights live: "cuda" selects NCCL (the tensor transport follows
    the tensors: CUDA-IPC handles for CUDA tensors, shared memory for CPU ones). `adapter`: every
    push is that LoRA adapter, served by the engines under its name (LoRA's adapter sync).

    disk: `snapshot_dir` is required (e.g. RUN_DIR/weights); `source_model` makes each snapshot a complete
    HF checkpoint (config and tokenizer copied). distributed: `master_address` must reach the engines.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"weight sync device must be 'cpu' or 'cuda', got {device!r}")
    if cfg.transport == "distributed":
        return DistributedTransport(fleet, bucket_bytes=cfg.bucket_bytes, backend="nccl" if device == "cuda" else "gloo",
                                    device=device, master_address=master_address, timeout_s=timeout_s,
                                    adapter=adapter)
    if cfg.transport == "tensor":
        return TensorTransport(fleet, bucket_bytes=cfg.bucket_bytes, adapter=adapter)
    if cfg.transport == "disk":
        if snapshot_dir is None:
            raise ValueError("sync.transport = 'disk' needs snapshot_dir (where weight snapshots are written)")
        return DiskTransport(fleet, snapshot_dir, bucket_bytes=cfg.bucket_bytes, keep_last=keep_snapshots,
                             source_model=source_model, adapter=adapter)
    raise ValueError(f"sync.transport {cfg.transport!r} is not one of distributed, tensor, disk")


def build_syncer(
    cfg: SyncConfig, fleet: EngineFleet, *, logprobs_fn: LogprobsFn | None = None, temperature: float = 1.0,
    transport: WeightTransport | None = None, **transport_options,
) -> WeightSyncer:
    """The syncer of `cfg`. With `cfg.check_weights`, `logprobs_fn` (the trainer's `logprobs`) and its
    `temperature` are required for the check; `transport_options` go to `build_transport` (with `adapter`,
    the check's probes name the adapter)."""
    checker = None
    if cfg.check_weights:
        if logprobs_fn is None:
            raise ValueError("sync.check_weights = true needs logprobs_fn (the trainer's logprobs) to compare against")
        adapter = transport_options.get("adapter")
        checker = LogprobChecker(logprobs_fn, temperature=temperature, lora_path=adapter.name if adapter else None)
    transport = transport or build_transport(cfg, fleet, **transport_options)
    return WeightSyncer(fleet, transport, pause_mode=cfg.pause_mode, interval=cfg.interval, checker=checker)
