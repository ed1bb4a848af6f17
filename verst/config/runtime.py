"""Where and how a run executes: weight sync, the buffer, the cluster, the teacher, evaluation, checkpoints,
logging and fault handling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from verst.config.registries import EngineKindName, TransportName
from verst.config.section import RESERVED_RESOURCES, Section


class SyncConfig(Section):
    transport: TransportName = Field(
        "distributed", description="A registered weight transport: distributed (a process-group broadcast), tensor "
        "(shared memory; CUDA IPC), disk (safetensors snapshots).")
    bucket_bytes: int = Field(512 * 2**20, ge=2**16, description="Bucket size for bucketed weight pushes.")
    interval: int = Field(1, ge=1, description="Push weights every N train steps.")
    check_weights: bool = Field(False, description="After the first sync, verify every engine's weights equal the trainer's.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="How in-flight requests are paused during a weight update."
    )


class BufferConfig(Section):
    path: str | None = Field(None, description="Import path of a replacement data buffer.")
    capacity_factor: float = Field(2.0, ge=1.0, description="Capacity = factor × groups per train step.")
    max_staleness: int | None = Field(None, ge=0, description="Drop groups older than this many versions; None keeps all.")
    unused: Literal["drop", "return"] = Field("drop", description="Discarded groups are dropped or returned to the source.")


class ClusterConfig(Section):
    placement: Literal["colocated", "disaggregated"] = Field(
        "disaggregated", description="Trainer and engines share devices (colocated) or not."
    )
    num_engines: int = Field(1, ge=1, description="Rollout engines.")
    trainer_ranks: int = Field(1, ge=1, description="Trainer processes (FSDP2 ranks).")
    engine: EngineKindName = Field(
        "embedded", description="Inference engine: embedded (verst's own), vllm (a vLLM server; `make vllm` installs "
        "it on CPU) or sglang (an SGLang server; CUDA only). docs/engines.md says which runs where.")
    engine_python: str | None = Field(
        None, description="Python of the environment that runs the engine server (vllm: default "
        "$VERST_VLLM_PYTHON, else .venv-vllm/bin/python; sglang: verst's own Python).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device; auto picks cuda when available.")
    ray_address: str | None = Field(
        None, description="Join an existing Ray cluster at this address (host:port of its head, or 'auto'); the "
        "cluster is left running at the end. None starts a local one-node Ray for the run.")
    trainer_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each trainer rank's bundle also asks for, e.g. "
        "{\"trainer_node\": 1}: the ranks go only to nodes started with them (`ray start --resources`).")
    engine_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each engine's bundle also asks for, e.g. "
        "{\"engine_node\": 1}: the engines go only to nodes started with them.")
    router: Literal["auto", "always"] = Field(
        "auto", description="sglang-router in front of the engines: auto uses it for two or more engines and calls "
        "a single engine directly (a router hop there costs throughput and routes nothing); always uses it anyway."
    )
    cores: int | None = Field(
        None, ge=1, description="CPU: how many of the cores this process may run on the run divides between the "
        "trainer ranks and the embedded engines, each process pinned to its share (None: all of them). A side "
        "computing alone (sync) gets every core in turn; one_step_off and fully_async split them, re-split from "
        "each side's measured work (docs/cluster.md, 'Cores and threads on CPU').")
    trainer_threads: int | None = Field(
        None, ge=1, description="CPU: each trainer rank's torch threads, on its planned cores (None: one per core).")
    engine_threads: int | None = Field(
        None, ge=1, description="CPU: each embedded engine's torch threads, on its planned cores (None: one per core).")

    @field_validator("ray_address")
    @classmethod
    def _driver_on_a_node(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError(f"{value!r}: Ray Client addresses (ray://) are not supported; run verst on a node of "
                             "the cluster and give its head as HOST:PORT (or 'auto')")
        return value

    @field_validator("trainer_resources", "engine_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in RESERVED_RESOURCES or not name:
                raise ValueError(f"{name!r} is not a custom resource (verst sets {', '.join(RESERVED_RESOURCES)} "
                                 "itself); name one declared with `ray start --resources`")
            if not amount > 0:
                raise ValueError(f"{name!r}: the amount {amount} must be > 0")
        return value


class TeacherConfig(Section):
    model_path: str | None = Field(
        None, description="On-policy distillation: the teacher's Hugging Face checkpoint directory (the student's "
        "tokenizer); None: no teacher.")
    num_engines: int = Field(
        1, ge=1, description="Engines serving the teacher, each in a placement bundle of its own (a GPU each on "
        "GPU), of kind cluster.engine; they score samples and are never in the weight sync.")


class EvalConfig(Section):
    path: str | None = Field(None, description="Held-out prompts; default data.test_path.")
    interval: int = Field(0, ge=0, description="Evaluate every N train steps (0: only before and after).")
    max_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation.")
    max_response_tokens: int | None = Field(None, ge=1, description="Default rollout.max_response_tokens.")
    batch_size: int = Field(64, ge=1, description="Prompts per generation batch.")
    on_error: Literal["skip", "stop"] = Field(
        "skip", description="A failed or timed-out evaluation: skip it (logged as eval/skipped) and train on, or stop the run.")
    max_in_flight: int = Field(
        1, ge=1, description="Evaluations outstanding at once; with the rollout engines (no eval.backend) the "
        "next weight push waits for the one in flight anyway.")
    overflow: Literal["backpressure", "skip"] = Field(
        "backpressure", description="An evaluation point that finds eval.max_in_flight outstanding: wait for the "
        "oldest to finish, or skip the point (eval/skipped_busy).")
    backend: str | None = Field(
        None, description="Score with this function instead of the rollout engines, by import path "
        "('package.module:function'): it gets a Hugging Face snapshot directory of the weights at a step and "
        "the step, and returns metrics (logged under eval/) or raises verst.eval.EvalSkip(reason).")
    num_engines: int = Field(
        0, ge=0, description="Engines of an evaluation fleet, each in a placement bundle of its own (a GPU each on "
        "GPU), of kind cluster.engine, behind a router of their own and outside the weight sync: each evaluation "
        "point's snapshot is loaded onto them and scored while training goes on; 0: no fleet.")
    keep_snapshots: int = Field(2, ge=0, description="eval.backend and the evaluation fleet: evaluation snapshots "
                                "kept once scored (RUN/eval_snapshots/).")


class CheckpointConfig(Section):
    interval: int = Field(0, ge=0, description="Save every N train steps (0: only at the end).")
    load: str | None = Field(None, description="Resume from this checkpoint: a step directory, or a run "
                             "directory (its latest checkpoint).")
    save: bool = Field(True, description="Save a resumable checkpoint at the end.")
    keep_last: int = Field(3, ge=0, description="Keep only the newest N checkpoints, never removing the one "
                           "`latest` names (0: keep all).")
    on_signal: bool = Field(True, description="RL: on SIGINT or SIGTERM (Ctrl-C, a preemption), stop at the end of "
                            "the train step and save a checkpoint first, if both fit in 20 s of the signal (within "
                            "the 30 s Kubernetes and Slurm wait before SIGKILL); false stops where the run is.")
    export_hf: bool = Field(True, description="Export the final model as a Hugging Face checkpoint (with LoRA: "
                            "the PEFT adapter directory).")
    merge_lora: bool = Field(False, description="With LoRA and export_hf: also export the merged model (base + "
                             "adapter) as a full Hugging Face checkpoint, in hf/merged.")


class LoggingConfig(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run directory.")
    wandb: bool = Field(False, description="Log to Weights & Biases (must be installed).")
    wandb_project: str = Field("verst", description="Weights & Biases project.")
    progress: bool = Field(True, description="Show a live progress display.")
    sample_groups_per_step: int = Field(
        2, ge=0, description="RL: groups per train step whose samples (prompt, response, reward) go to the run's "
        "samples.jsonl, which the report shows; 0 writes none.")


class FaultConfig(Section):
    step_timeout_s: float = Field(1800.0, gt=0, description="Limit of one train step on the trainer ranks.")
    rollout_timeout_s: float = Field(1800.0, gt=0, description="Limit of one rollout step, or of one fully async take.")
    sync_timeout_s: float = Field(900.0, gt=0, description="Limit of one weight sync (pause, push, continue).")
    eval_timeout_s: float = Field(1800.0, gt=0, description="Limit of one held-out evaluation.")
    engine_call_timeout_s: float = Field(
        60.0, gt=0, description="Limit of one engine control call (pause, continue, flush, versions, server info).")
    tolerate_engines: bool = Field(
        True, description="Restart an engine that dies or hangs and train on; false stops the run naming the engine.")
    health_interval_s: float = Field(2.0, gt=0, description="Seconds between two /health polls of each engine.")
    health_failures: int = Field(3, ge=1, description="Failed /health polls in a row after which an engine is restarted.")
    generate_retries: int = Field(
        5, ge=0, description="With tolerate_engines: times a generation whose engine went away is sent again.")
    max_restarts: int = Field(
        0, ge=0, description="Times a run whose trainer rank died restarts from its latest checkpoint, in the same "
        "process (needs checkpoint.interval > 0); 0 stops the run naming the rank and the last checkpoint.")


