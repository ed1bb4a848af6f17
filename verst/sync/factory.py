"""`SyncConfig` → a transport and a syncer: `sync.transport` names a registered transport class
(`verst.config.registries.WEIGHT_TRANSPORTS`), which builds itself for the device (gloo or NCCL for the
broadcast).
"""

from __future__ import annotations

from pathlib import Path

from verst.config.registries import WEIGHT_TRANSPORTS
from verst.config.schema import SyncConfig
from verst.inference_client.fleet import EngineFleet
from verst.sync.check import LogprobChecker, LogprobsFn
from verst.sync.syncer import WeightSyncer
from verst.sync.transport import AdapterSpec, TransportOptions, WeightTransport


def build_transport(
    cfg: SyncConfig, fleet: EngineFleet, *, device: str = "cpu", snapshot_dir: str | Path | None = None,
    keep_snapshots: int = 2, source_model: str | Path | None = None, master_address: str = "127.0.0.1",
    timeout_s: float = 60.0, adapter: AdapterSpec | None = None,
) -> WeightTransport:
    """The registered transport `cfg.transport`, built from the options it uses (`TransportOptions`).
    `device` is where the trainer's full weights live: "cuda" selects NCCL for the broadcast (the tensor
    transport follows the tensors: CUDA-IPC handles for CUDA tensors, shared memory for CPU ones)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"weight sync device must be 'cpu' or 'cuda', got {device!r}")
    options = TransportOptions(cfg.bucket_bytes, device=device, snapshot_dir=snapshot_dir,
                               keep_snapshots=keep_snapshots, source_model=source_model,
                               master_address=master_address, timeout_s=timeout_s, adapter=adapter)
    return WEIGHT_TRANSPORTS.load(cfg.transport).build(fleet, options)


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
    return WeightSyncer(fleet, transport, pause_mode=cfg.pause_mode, interval=cfg.interval, checker=checker,
                        label=cfg.transport)
