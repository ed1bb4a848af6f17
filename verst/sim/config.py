"""`verst sim`'s own settings (`[sim]` in the recipe, `--sim.field VALUE` on the command line): the clock, the
latency model's inputs, the workload the simulated data and agent make, and the faults to inject. The rest of
the run is the ordinary config: `cluster.num_engines` engines, `cluster.trainer_ranks` trainer ranks.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from verst.config.section import Section
from verst.sim.latency import HARDWARE, EngineCosts, ModelShape, TrainerCosts


class SimConfig(Section):
    speedup: float = Field(1.0, gt=0, description="Simulated seconds per wall second (below 1 slows the run down "
                           "so that this machine keeps pace with a large fleet).")
    hardware: Literal["h100", "gb300"] = Field("h100", description="The GPU the latency model assumes.")
    gpus_per_engine: int = Field(1, ge=1, description="GPUs of one engine (tensor or expert parallel).")
    total_params: float = Field(8e9, gt=0, description="The served model's parameters.")
    active_params: float = Field(8e9, gt=0, description="Parameters each token runs through (a mixture of "
                                 "experts' active ones; the total for a dense model).")
    kv_bytes_per_token: float = Field(131072, gt=0, description="KV cache bytes of one token over every layer "
                                      "(Llama-3-8B: 2 · 32 layers · 8 KV heads · 128 · 2 bytes).")
    bytes_per_param: float = Field(2.0, gt=0, description="Bytes of one served and pushed parameter: 1, 2 or 4 "
                                   "(fp8, bf16, fp32).")
    bandwidth_efficiency: float = Field(0.7, gt=0, le=1, description="Fraction of HBM bandwidth a decode step reaches.")
    prefill_mfu: float = Field(0.5, gt=0, le=1, description="Fraction of peak FLOP/s a prefill reaches.")
    decode_mfu: float = Field(0.3, gt=0, le=1, description="Fraction of peak FLOP/s a compute-bound decode reaches.")
    step_overhead_s: float = Field(0.001, ge=0, description="Scheduler and launch seconds of every decode step.")
    kv_memory_fraction: float = Field(0.85, gt=0, le=1, description="Share of memory after the weights for KV cache.")
    load_bytes_per_s: float = Field(25e9, gt=0, description="Bytes per second new weights reach one engine.")
    max_running: int = Field(256, ge=1, description="Requests one engine decodes at once at most.")
    engine_restart_s: float = Field(60.0, ge=0, description="Simulated seconds a restarted engine takes to serve.")
    trainer_mfu: float = Field(0.4, gt=0, le=1, description="Model FLOPs utilisation of the simulated trainer.")
    trainer_gpus: int | None = Field(None, ge=1, description="GPUs of the simulated trainer; default "
                                     "cluster.trainer_ranks.")
    fleet_processes: int = Field(1, ge=1, description="Processes the simulated engines are spread over.")
    response_tokens_mean: float = Field(256, ge=1, description="Mean tokens an engine samples per request "
                                        "(lognormal, capped by the request's max_new_tokens).")
    response_tokens_sigma: float = Field(0.5, ge=0, description="Log-space spread of the sampled lengths.")
    prompt_tokens: int = Field(128, ge=1, description="Length of the simulated prompts, in characters (tokens of a "
                               "character tokenizer).")
    prompts: int = Field(4096, ge=1, description="Prompts in the simulated data set.")
    zero_variance_fraction: float = Field(0.3, ge=0, le=1, description="Share of prompts whose samples all get one "
                                          "reward (a zero-variance group, dropped by the zero_std filter).")
    agent_turns: int = Field(0, ge=0, description="Agentic turns per trajectory through the session server; 0: "
                             "single-turn generation.")
    env_seconds: float = Field(0.0, ge=0, description="Simulated seconds the environment takes between two turns.")
    observation_tokens: int = Field(64, ge=0, description="Characters the environment appends after each turn.")
    kill_fraction: float = Field(0.0, ge=0, le=1, description="Share of the engines killed during the run.")
    stall_fraction: float = Field(0.0, ge=0, le=1, description="Share of the engines that stop answering.")
    slow_fraction: float = Field(0.0, ge=0, le=1, description="Share of the engines that slow down.")
    slow_factor: float = Field(3.0, ge=1, description="How much slower a slowed engine's decode steps, prefills and weight loads are.")
    refuse_load_fraction: float = Field(0.0, ge=0, le=1, description="Share of the engines that refuse weight loads.")
    fault_after_steps: int = Field(2, ge=0, description="Train steps after which the faults strike.")
    warmup_steps: int = Field(0, ge=0, description="Train steps before scale.json's measurement window opens.")

    @field_validator("bytes_per_param")
    @classmethod
    def _a_dtype_width(cls, value: float) -> float:
        if value not in (1, 2, 4):
            raise ValueError(f"sim.bytes_per_param = {value:g} is not 1, 2 or 4 (fp8, bf16, fp32)")
        return value

    def model(self) -> ModelShape:
        return ModelShape(self.total_params, self.active_params, self.kv_bytes_per_token, self.bytes_per_param)

    def engine_costs(self) -> EngineCosts:
        return EngineCosts(self.model(), HARDWARE[self.hardware], self.gpus_per_engine, self.bandwidth_efficiency,
                           self.prefill_mfu, self.decode_mfu, self.step_overhead_s, self.kv_memory_fraction,
                           self.load_bytes_per_s)

    def engine_costs_inputs(self) -> dict:
        """`engine_costs()` as plain data, for the fleet processes."""
        m = self.model()
        return {"model": {"total_params": m.total_params, "active_params": m.active_params,
                          "kv_bytes_per_token": m.kv_bytes_per_token, "bytes_per_param": m.bytes_per_param},
                "hardware": self.hardware, "gpus": self.gpus_per_engine,
                "bandwidth_efficiency": self.bandwidth_efficiency, "prefill_mfu": self.prefill_mfu,
                "decode_mfu": self.decode_mfu, "step_overhead_s": self.step_overhead_s,
                "kv_memory_fraction": self.kv_memory_fraction, "load_bytes_per_s": self.load_bytes_per_s}

    def trainer_costs(self, trainer_ranks: int) -> TrainerCosts:
        return TrainerCosts(self.model(), HARDWARE[self.hardware], self.trainer_gpus or trainer_ranks, self.trainer_mfu)
