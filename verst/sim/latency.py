"""What a simulated engine and a simulated trainer cost, in simulated seconds: a roofline of the hardware's
memory bandwidth and compute, with the efficiencies and the fixed step overhead written down as inputs.

Decode is memory bound at small batch (the weights are read once per step, the KV cache of every sequence
in the batch too) and compute bound at large batch; prefill is compute bound; a weight load is bytes over
the transfer bandwidth; a train step is 6·N·tokens over the trainer's GPUs at a model FLOPs utilisation.
docs/scale.md names the figures each input comes from.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU: HBM bandwidth (bytes/s), dense bf16 peak (FLOP/s) and memory (bytes), as its vendor states."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: float
    memory_bytes: float


# Vendor datasheets (docs/scale.md): H100 SXM 3.35 TB/s HBM3, 989 TFLOP/s dense bf16, 80 GB; Blackwell Ultra
# (GB300) 8 TB/s HBM3e, 288 GB, about 2.5 PFLOP/s dense bf16.
HARDWARE = {
    "h100": Hardware("h100", 3.35e12, 989e12, 80e9),
    "gb300": Hardware("gb300", 8.0e12, 2.5e15, 288e9),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The served model as the latency model sees it. `kv_bytes_per_token`: every layer's K and V of one
    token (2 · layers · kv heads · head dim · bytes; an MLA model caches its latent instead)."""

    total_params: float
    active_params: float
    kv_bytes_per_token: float
    bytes_per_param: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.bytes_per_param


@dataclasses.dataclass(frozen=True)
class EngineCosts:
    """The cost model of one inference engine of `gpus` GPUs serving `model` on `hardware`.

    `bandwidth_efficiency` and `prefill_mfu`/`decode_mfu` are the fractions of the peaks a tuned server
    reaches; `step_overhead_s` is the scheduler and launch time of every step; `kv_memory_fraction` the
    share of the memory left after the weights that holds KV cache. `load_bytes_per_s`: how fast new
    weights arrive at one engine (the transport's link, not HBM)."""

    model: ModelShape
    hardware: Hardware
    gpus: int = 1
    bandwidth_efficiency: float = 0.7
    prefill_mfu: float = 0.5
    decode_mfu: float = 0.3
    step_overhead_s: float = 0.001
    kv_memory_fraction: float = 0.85
    load_bytes_per_s: float = 25e9

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"the model's weights ({self.model.weight_bytes / 1e9:.0f} GB) leave no KV cache on "
                             f"{self.gpus} × {self.hardware.name} ({self.hardware.memory_bytes / 1e9:.0f} GB each)")

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache the engine holds: what bounds its batch."""
        free = self.gpus * self.hardware.memory_bytes - self.model.weight_bytes
        return int(max(free, 0.0) * self.kv_memory_fraction / self.model.kv_bytes_per_token)

    def weight_bytes_read(self, batch: int) -> float:
        """Weight bytes one decode step reads. Each token reads the share active/total of the weights; of a
        mixture of experts the batch's tokens read the union of theirs, as if each drew its share
        independently: total · (1 − (1 − active/total)^batch) (a dense model: all of them)."""
        m = self.model
        share = m.active_params / m.total_params
        return m.weight_bytes * (1.0 - (1.0 - share) ** batch) if share < 1.0 else m.weight_bytes

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` sequences holding `context_tokens` tokens of KV in all."""
        if batch <= 0:
            return 0.0
        hw = self.hardware
        read = self.weight_bytes_read(batch) + self.model.kv_bytes_per_token * context_tokens
        memory = read / (self.gpus * hw.hbm_bytes_per_s * self.bandwidth_efficiency)
        compute = 2.0 * self.model.active_params * batch / (self.gpus * hw.peak_flops * self.decode_mfu)
        return self.step_overhead_s + max(memory, compute)

    def prefill_s(self, tokens: int) -> float:
        """Prefilling `tokens` new prompt tokens (cached ones cost nothing)."""
        if tokens <= 0:
            return 0.0
        return 2.0 * self.model.active_params * tokens / (self.gpus * self.hardware.peak_flops * self.prefill_mfu)

    def load_s(self, nbytes: float) -> float:
        """Receiving and installing `nbytes` of new weights."""
        return nbytes / self.load_bytes_per_s


@dataclasses.dataclass(frozen=True)
class TrainerCosts:
    """The simulated trainer: a step over `tokens` costs 6 · active params · tokens FLOPs (forward and
    backward) on `gpus` GPUs at `mfu`; the old-policy logprob pass, when the step takes one, 2 · N · tokens."""

    model: ModelShape
    hardware: Hardware
    gpus: int
    mfu: float = 0.4

    def step_s(self, tokens: int) -> float:
        return 6.0 * self.model.active_params * tokens / (self.gpus * self.hardware.peak_flops * self.mfu)

    def forward_s(self, tokens: int) -> float:
        return 2.0 * self.model.active_params * tokens / (self.gpus * self.hardware.peak_flops * self.mfu)
