"""The typed config tree: one pydantic model per concern, a doc line and a range on every field.

Defaults live here and nowhere else. Cross-field checks (batch arithmetic, schedule vs placement)
run at start-up with the numbers in the message. Importing this module never imports torch.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from verst.config.device_rules import check_colocated_broadcast
from verst.types.sampling import SamplingKnobs

# Which model class runs a checkpoint: verst's native one (dense Llama-family, built without transformers:
# verst.models.native), transformers', or auto (native where it applies).
ModelImpl = Literal["auto", "native", "transformers"]
MODEL_IMPLS: tuple[str, ...] = get_args(ModelImpl)
# Ray resources a placement bundle sets itself (verst_slot: the CPU placement's unit, see
# verst.orchestration.ray_session); cluster.*_resources name custom ones besides.
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory", "verst_slot")


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = Field("artifacts/models/tiny-qwen3", description="Hugging Face checkpoint directory (config, weights, tokenizer).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype; float32 on CPU, bfloat16 on GPU."
    )
    trust_remote_code: bool = Field(False, description="Allow model code shipped inside the checkpoint directory.")
    impl: ModelImpl = Field(
        "auto", description="Model class of the embedded engines and the trainer: native (dense Llama-family, "
        "no transformers import), transformers, or auto (native where it applies; the trainer on CUDA: "
        "transformers, for flash attention and packed sequences).",
    )


class DataConfig(Section):
    source: str | None = Field(None, description="Import path of a replacement data source (the DataSource protocol).")
    train_path: str = Field("artifacts/data/addition/train.jsonl", description="Training prompts (JSONL or Parquet).")
    test_path: str | None = Field("artifacts/data/addition/test.jsonl", description="Held-out prompts for evaluation.")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="File format; auto picks by extension.")
    prompt_key: str = Field("prompt", description="Column holding the prompt (text or a list of chat messages).")
    label_key: str | None = Field("label", description="Column holding the reference answer.")
    metadata_key: str | None = Field("metadata", description="Column holding per-prompt metadata (a dict).")
    tools_key: str | None = Field("tools", description="Column holding tool schemas for the chat template.")
    apply_chat_template: bool = Field(True, description="Render prompts with the tokenizer's chat template.")
    system_prompt: str | None = Field(None, description="System message prepended to text prompts.")
    shuffle: bool = Field(True, description="Reshuffle prompts every epoch.")
    seed: int = Field(42, description="Seed of the prompt shuffle.")


class SamplingConfig(Section, SamplingKnobs):  # temperature, top_p, top_k: shared with the engines' wire
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end generation.")
    seed: int | None = Field(None, description="Base sampling seed (per request: seed + sample index); None is random.")


class RolloutConfig(Section):
    batch_size: int = Field(32, ge=1, description="Prompts per rollout step.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Trajectories per prompt (the group size).")
    over_sampling_batch_size: int | None = Field(
        None, ge=1, description="Prompts launched per rollout step before filtering; default batch_size."
    )
    num_rollouts: int = Field(100, ge=0, description="Rollout steps to run (each feeds one or more train steps).")
    max_prompt_tokens: int = Field(256, ge=1, description="Prompts longer than this (in tokens, after the chat template) are rejected.")
    max_response_tokens: int = Field(16, ge=1, description="Maximum new tokens per engine call.")
    max_context_tokens: int | None = Field(None, ge=2, description="Cap on prompt + response of one trajectory.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling parameters.")
    dynamic_filter: str | None = Field(
        None, description="Group filter by name ('zero_std', DAPO) or import path; rejected groups are dropped."
    )
    rollout_fn: str | None = Field(None, description="Import path of a rollout fn (owns data, batching, rewards).")
    generate_fn: str | None = Field(None, description="Import path of a generate fn (owns one sample's generation).")
    agent_fn: str | None = Field(None, description="Import path of an agent fn (owns the episode loop).")
    submission_granularity: Literal["sample", "group"] = Field(
        "sample", description="Fully async: a finished sample (or only a whole group) frees its place."
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="Fully async: trajectories generating at once; default batch_size × n_samples_per_prompt."
    )
    return_partial_to_source: bool = Field(
        False, description="Return the prompts (not the partial output) of groups aborted at the end of a step to the source."
    )
    max_over_sampling_rounds: int = Field(
        32, ge=1, description="Rounds of over-sampling one step may launch before failing with the counts."
    )
    abort_timeout_s: float = Field(10.0, gt=0, description="Wait for aborted requests to end before cancelling them.")
    dump_dir: str | None = Field(None, description="Rollout-only debugging: write every step's samples here.")
    concurrency: int = Field(256, ge=1, description="Concurrent requests to the engines.")
    request_batch: int = Field(
        64, ge=1, description="Generate calls started together go to an engine as batched requests of up to this "
        "many prompts (1: one HTTP request per call). Only without a router: sglang-router 0.3 takes one rid per request."
    )


class RewardConfig(Section):
    type: str = Field(
        "numeric_match",
        description="Built-in reward name (exact_match, numeric_match, math_verify, token_f1), 'remote', or 'custom'.",
    )
    path: str | None = Field(None, description="Import path of a custom reward fn (type = 'custom').")
    url: str | None = Field(None, description="Remote reward endpoint (type = 'remote').")
    timeout_s: float = Field(30.0, gt=0, description="Remote reward request timeout in seconds.")
    max_concurrency: int = Field(32, ge=1, description="Remote reward requests in flight at once.")
    group: bool = Field(False, description="Call the reward once per group with all its samples.")
    key: str | None = Field(None, description="Key that selects the scalar from a dict reward.")


class AlgorithmConfig(Section):
    advantage_estimator: Literal[
        "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
    ] = Field("grpo", description="How rewards become per-token advantages.")
    grpo_std_normalization: bool = Field(True, description="GRPO: divide by the group std (off = Dr.GRPO style).")
    policy_loss: Literal["ppo_clip", "gspo"] = Field("ppo_clip", description="Token-level PPO clip or sequence-level GSPO.")
    eps_clip: float = Field(0.2, gt=0, description="Lower clip range of the importance ratio.")
    eps_clip_high: float | None = Field(None, gt=0, description="Upper clip range (clip-higher); default eps_clip.")
    dual_clip_c: float | None = Field(None, gt=1, description="Dual-clip constant for negative advantages; None disables.")
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = Field(
        "token_mean", description="How per-token losses reduce to one number."
    )
    kl_loss_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss (needs a reference model).")
    kl_penalty_coef: float = Field(0.0, ge=0, description="REINFORCE++: token-level KL penalty folded into rewards.")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (REINFORCE++, GAE).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    value_clip: float = Field(0.2, gt=0, description="PPO value-loss clip range.")
    whiten_advantages: bool = Field(
        False, description="Whiten the advantages of every estimator: (A − mean) / std over the step's policy tokens."
    )
    mismatch_correction: Literal[
        "none", "tis", "mis_token", "mis_sequence", "mis_geometric", "icepop", "band_mask"
    ] = Field(
        "none", description="Train–inference mismatch correction from rollout logprobs: tis (truncated weight), "
        "mis_token (weight ρ inside the band, 0 outside; icepop is the same), mis_sequence, mis_geometric, "
        "band_mask (a 0/1 band mask, no reweighting).",
    )
    tis_clip: float = Field(2.0, gt=0, description="Upper bound of the truncated importance weight / band.")
    tis_clip_low: float = Field(0.0, ge=0, description="Lower bound of the importance weight / band.")
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto",
        description="The old policy's logprobs: recompute (a forward pass over the rollout batch before its first "
        "optimizer step), rollout (the engine's, no extra pass), or auto: the train step's own forward, detached, "
        "where that is exact (one optimizer step per rollout batch and kl_penalty_coef = 0), else recompute.",
    )
    distill_coef: float = Field(
        0.0, ge=0, description="On-policy distillation: per-token advantage distill_coef × (teacher logprob − "
        "old policy logprob) added to the task's (needs teacher.model_path); 0 is pure RL.",
    )
    reward_coef: float = Field(
        1.0, ge=0, description="Weight of the task reward's advantages; 0 with distill_coef > 0 is pure on-policy "
        "distillation (the reward is still computed and logged, not trained on).",
    )
    opsm_delta: float | None = Field(
        None, ge=0, description="Off-policy sequence masking (DeepSeek-V3.2): drop negative-advantage tokens of "
        "sequences whose KL(rollout ‖ current policy) exceeds this; None disables.",
    )
    kl_importance_weighted: bool = Field(
        False, description="Weight the KL-to-reference loss by π/π_old (DeepSeek-V3.2's unbiased KL estimate); "
        "needs kl_loss_coef > 0.",
    )
    mismatch_fn: str | None = Field(
        None, description="Import path of a custom mismatch correction (docs/plugins.md); replaces mismatch_correction.",
    )
    policy_loss_fn: str | None = Field(
        None, description="Import path of a custom per-token policy loss (docs/plugins.md); replaces policy_loss.",
    )
    loss_reducer: str | None = Field(
        None, description="Import path of a custom loss reducer (docs/plugins.md); replaces loss_aggregation's "
        "reduction of every loss term (metrics keep it).",
    )
    routing_replay: Literal["off", "measure", "replay"] = Field(
        "off", description="MoE (R3): the engines record each token's routed experts on the samples; measure "
        "logs train/routing_mismatch_rate, replay also makes the trainer's MoE layers use exactly those experts.",
    )
    true_on_policy: bool = Field(
        False, description="The engines report logprobs from the trainer's own forward (each sequence alone), "
        "bitwise equal to the trainer's; CPU float32, native model, embedded engines, no LoRA (docs/algorithms.md).",
    )

    @property
    def needs_reference(self) -> bool:
        """A KL loss or a KL penalty needs the frozen reference model's logprobs."""
        return self.kl_loss_coef > 0 or self.kl_penalty_coef > 0

    @property
    def needs_critic(self) -> bool:
        """PPO's GAE needs a value model's per-token values."""
        return self.advantage_estimator == "ppo"

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.mismatch_correction != "none" and self.old_logprobs == "rollout":
            raise ValueError(
                f"algorithm.mismatch_correction = {self.mismatch_correction!r} corrects rollout vs trainer "
                "logprobs; it cannot be combined with algorithm.old_logprobs = 'rollout'"
            )
        if self.mismatch_fn is not None:
            if self.mismatch_correction != "none":
                raise ValueError(
                    f"algorithm.mismatch_fn = {self.mismatch_fn!r} replaces algorithm.mismatch_correction = "
                    f"{self.mismatch_correction!r}; set one of them"
                )
            if self.old_logprobs == "rollout":
                raise ValueError(
                    f"algorithm.mismatch_fn = {self.mismatch_fn!r} corrects rollout vs trainer logprobs; it cannot "
                    "be combined with algorithm.old_logprobs = 'rollout'"
                )
        if self.kl_importance_weighted and self.kl_loss_coef == 0:
            raise ValueError("algorithm.kl_importance_weighted = true weights the KL loss, which is off: "
                             "set algorithm.kl_loss_coef > 0")
        token_kl = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
        if self.kl_penalty_coef > 0 and self.advantage_estimator not in token_kl:
            raise ValueError(
                f"algorithm.kl_penalty_coef = {self.kl_penalty_coef} needs a token-level estimator {token_kl}, "
                f"got algorithm.advantage_estimator = {self.advantage_estimator!r}"
            )
        if self.reward_coef == 0 and self.distill_coef == 0:
            raise ValueError("algorithm.reward_coef = 0 with algorithm.distill_coef = 0 leaves no training signal; "
                             "set algorithm.distill_coef > 0 (pure on-policy distillation) or algorithm.reward_coef > 0")
        if self.tis_clip_low >= self.tis_clip:
            raise ValueError(f"algorithm.tis_clip_low = {self.tis_clip_low} must be < algorithm.tis_clip = {self.tis_clip}")
        return self


class TrainerConfig(Section):
    backend: Literal["fsdp2"] = Field("fsdp2", description="Training backend.")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final lr as a fraction of the peak (cosine/linear).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Schedule after warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global grad norm to this value.")
    global_batch_size: int | None = Field(
        None, ge=1, description="Samples per optimizer step; default = rollout.batch_size × n_samples_per_prompt."
    )
    max_tokens_per_micro_batch: int = Field(
        8192, ge=1, description="Token budget of one packed micro-batch per rank (dynamic batch size)."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    seed: int = Field(1234, ge=0, description="Seed of the trainer's RNGs.")


class CriticConfig(Section):
    """PPO's value model (`algorithm.advantage_estimator = "ppo"`): the policy's architecture with its LM head
    replaced by a scalar head, on the trainer ranks next to the policy, trained by its own AdamW on the
    clipped value loss (`algorithm.value_clip`). Its other optimizer settings are the trainer's."""

    model_path: str | None = Field(
        None, description="Hugging Face causal LM checkpoint whose trunk initialises the value model (same "
        "tokenizer as the policy); default model.path.",
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate of the value model's AdamW.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps of the value model's learning rate.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the value model's global grad norm to this value.")


class LoraAdapterConfig(Section):
    """One adapter of a multi-LoRA run (`[[lora.adapters]]`): trained on the shared base with its own data,
    reward, batch plan and optimizer, served by the engines under `name`. Unset fields take the run's."""

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$",
                      description="The adapter's name: the engines serve it under it, its metrics are lora/<name>/..., "
                      "its export is hf/<name>.")
    rank: int | None = Field(None, ge=1, description="Rank r of this adapter; default lora.rank.")
    alpha: float | None = Field(None, gt=0, description="Scale numerator of this adapter; default lora.alpha.")
    dropout: float | None = Field(None, ge=0, lt=1, description="Input dropout of this adapter; default lora.dropout.")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="Linear layers this adapter targets; default lora.target_modules.")
    data: DataConfig | None = Field(None, description="This adapter's prompts (train and held-out); default data.")
    reward: RewardConfig | None = Field(None, description="This adapter's reward; default reward.")
    eval_path: str | None = Field(None, description="This adapter's held-out prompts; default its data.test_path "
                                  "(with its own data) or eval.path.")
    batch_size: int | None = Field(None, ge=1, description="Prompts per rollout step; default rollout.batch_size.")
    n_samples_per_prompt: int | None = Field(None, ge=1, description="Group size; default rollout.n_samples_per_prompt.")
    num_rollouts: int | None = Field(None, ge=0, description="Rollout steps of this adapter; default rollout.num_rollouts.")
    global_batch_size: int | None = Field(None, ge=1, description="Samples per optimizer step; default "
                                          "trainer.global_batch_size.")
    lr: float | None = Field(None, gt=0, description="Peak learning rate of this adapter's optimizer; default trainer.lr.")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name(cls, value: object) -> object:
        return [value] if isinstance(value, str) and value != "all-linear" else value


class LoraConfig(Section):
    """Low-rank adapters (PEFT's LoRA) on the trainer's model: only the adapters train. Weight sync sends
    the engines the adapter alone (served under `name`, on the base they keep) or the merged weights."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of every weight (RL and SFT).")
    rank: int = Field(8, ge=1, description="Rank r of each adapter (A: [r, in], B: [out, r]).")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update B·A is multiplied by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input while training.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Linear layers that get an adapter: names (a module's name or its last part, "
        "e.g. q_proj) or all-linear (every linear layer but the output head).",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter", description="What weight sync sends the engines: adapter (A and B of each targeted layer, "
        "loaded by the engines under `name` on the base they keep; every request names it) or merged (W + B·A · "
        "alpha / rank under the base's names, for engines without LoRA support).",
    )
    name: str = Field("policy", min_length=1, description="The engines' name of the trained adapter "
                      "(`lora_path` of every generation request) with sync = adapter.")
    adapters: list[LoraAdapterConfig] = Field(
        default_factory=list, description="Multi-LoRA: several adapters trained in one run on the shared base, each "
        "with its own data, reward, batch plan and optimizer ([[lora.adapters]]); empty: one adapter, `name`.")

    @property
    def served_adapter(self) -> str | None:
        """The adapter name generation requests give as `lora_path`: `name` with adapter sync, else None
        (no LoRA, or merged weights: the engines serve the policy as their base)."""
        return self.name if self.enabled and self.sync == "adapter" else None

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name(cls, value: object) -> object:
        """A single name (`--lora.target_modules q_proj`) is a list of one."""
        return [value] if isinstance(value, str) and value != "all-linear" else value

    @model_validator(mode="after")
    def _names(self) -> LoraConfig:
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise ValueError("lora.target_modules = [] names no module; name some (e.g. ['q_proj', 'v_proj']) "
                                 "or use 'all-linear'")
            blank = [name for name in self.target_modules if not name.strip()]
            if blank:
                raise ValueError(f"lora.target_modules holds an empty name: {self.target_modules}")
        return self


class SFTConfig(Section):
    """SFT imitates each prompt's label (data.label_key) as the assistant reply."""

    num_steps: int = Field(200, ge=1, description="Optimizer steps of supervised fine-tuning.")
    batch_size: int = Field(128, ge=1, description="Examples per optimizer step.")
    eval_interval: int = Field(0, ge=0, description="Evaluate every N steps (0: only before and after).")


class SyncConfig(Section):
    transport: Literal["distributed", "tensor", "disk"] = Field(
        "distributed", description="Weight transport: process-group broadcast, shared memory/IPC, or safetensors."
    )
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
    engine: Literal["embedded", "sglang", "vllm"] = Field(
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
    keep_last: int = Field(0, ge=0, description="Keep only the newest N checkpoints (0: keep all).")
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


Schedule = Literal["sync", "one_step_off", "fully_async"]
# A value of an engine's pass-through flag (`[vllm]`, `[sglang]`): true is the bare flag, a list gives each.
EngineFlag = str | int | float | bool | list[str | int | float]


def _check_true_on_policy(cfg: VerstConfig) -> None:
    """`algorithm.true_on_policy` holds only where engine and trainer can run the same CPU float32 forward."""
    if not cfg.algorithm.true_on_policy:
        return
    refusals = {
        "model.dtype": (cfg.model.dtype, cfg.model.dtype != "float32", "float32"),
        "model.impl": (cfg.model.impl, cfg.model.impl == "transformers", "'native' or 'auto'"),
        "cluster.engine": (cfg.cluster.engine, cfg.cluster.engine != "embedded", "'embedded'"),
        "cluster.device": (cfg.cluster.device, cfg.cluster.device == "cuda", "'cpu' or 'auto'"),
        "lora.enabled": (cfg.lora.enabled, cfg.lora.enabled, "false"),
        "algorithm.routing_replay": (cfg.algorithm.routing_replay, cfg.algorithm.routing_replay != "off", "'off'"),
    }
    for field, (value, refused, needed) in refusals.items():
        if refused:
            raise ValueError(
                f"algorithm.true_on_policy = true needs {field} = {needed} (the engine and the trainer run the same "
                f"CPU float32 native forward); got {field} = {value!r}")


class VerstConfig(Section):
    name: str = Field("run", min_length=1, description="Run name; the run directory is runs/<name> by default.")
    run_dir: str | None = Field(None, description="Run directory; default runs/<name>.")
    overwrite: bool = Field(False, description="Empty an existing, non-empty run directory first; without it "
                            "such a directory is refused, so two runs never mix their files.")
    schedule: Schedule = Field("sync", description="RL schedule: sync, one_step_off or fully_async.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout volume and sampling.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages and losses.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Optimizer and batching.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (off: full fine-tuning).")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="PPO's value model.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Supervised fine-tuning.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight synchronisation.")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="Data buffer.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Placement and process counts.")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="On-policy distillation's teacher.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics sinks.")
    fault: FaultConfig = Field(default_factory=FaultConfig, description="Hang limits; engine and trainer restarts.")
    vllm: dict[str, EngineFlag] = Field(
        default_factory=dict, description="vLLM server flags, passed unchanged (`--vllm.max-num-seqs 64` is "
        "`--max-num-seqs 64`; true: the bare flag). cluster.engine = 'vllm' only.")
    sglang: dict[str, EngineFlag] = Field(
        default_factory=dict, description="SGLang server flags, passed unchanged (`--sglang.mem-fraction-static "
        "0.7`; true: the bare flag). cluster.engine = 'sglang' only.")

    @model_validator(mode="after")
    def _cross_field_checks(self) -> VerstConfig:
        from verst.config.arithmetic import check_batch_arithmetic

        check_batch_arithmetic(self)
        if self.schedule == "fully_async" and self.cluster.placement == "colocated":
            raise ValueError(
                "schedule = 'fully_async' with cluster.placement = 'colocated' is refused: the fully async "
                "schedule needs trainer and engines running at once; use cluster.placement = 'disaggregated'"
            )
        if self.schedule == "fully_async" and self.rollout.rollout_fn:
            raise ValueError(
                f"rollout.rollout_fn = {self.rollout.rollout_fn!r} with schedule = 'fully_async' is refused: the fully "
                "async worker generates and scores samples itself (rollout.generate_fn and [reward]) and never calls "
                "a rollout fn; use schedule = 'sync' or 'one_step_off'")
        critic_fields = [f"critic.{name}" for name, field in CriticConfig.model_fields.items()
                         if getattr(self.critic, name) != field.default]
        if critic_fields and not self.algorithm.needs_critic:
            raise ValueError(
                f"{', '.join(critic_fields)} changed from the default, but only algorithm.advantage_estimator = "
                f"'ppo' trains a value model (got {self.algorithm.advantage_estimator!r}); remove them or use ppo")
        if self.algorithm.distill_coef > 0 and self.teacher.model_path is None:
            raise ValueError(
                f"algorithm.distill_coef = {self.algorithm.distill_coef} needs a teacher's logprobs: set "
                "teacher.model_path (the teacher's checkpoint directory), or algorithm.distill_coef = 0")
        if self.teacher.model_path is not None and self.algorithm.distill_coef == 0:
            raise ValueError(
                f"teacher.model_path = {self.teacher.model_path!r} with algorithm.distill_coef = 0: the teacher would "
                "score every sample and train nothing; set algorithm.distill_coef > 0 or remove teacher.model_path")
        if self.fault.max_restarts and not self.checkpoint.interval:
            raise ValueError(
                f"fault.max_restarts = {self.fault.max_restarts} restarts a run from its latest checkpoint, but "
                "checkpoint.interval = 0 saves none before the end; set checkpoint.interval > 0")
        if self.lora.served_adapter and self.cluster.engine != "embedded" and self.sync.transport != "disk":
            raise ValueError(
                f"lora.sync = 'adapter' with sync.transport = {self.sync.transport!r}: only the embedded engine loads "
                f"an adapter from pushed tensors, not cluster.engine = {self.cluster.engine!r}; use sync.transport = "
                "'disk' (an adapter directory loaded with /load_lora_adapter) or lora.sync = 'merged'")
        _check_true_on_policy(self)
        if self.algorithm.routing_replay != "off" and self.cluster.engine == "vllm":
            raise ValueError(
                f"algorithm.routing_replay = {self.algorithm.routing_replay!r} needs engines that return routed "
                f"experts on every reply; cluster.engine = {self.cluster.engine!r} is not wired for it, use 'embedded' "
                "or 'sglang'")
        if self.algorithm.routing_replay != "off" and self.rollout.agent_fn:
            raise ValueError(
                f"algorithm.routing_replay = {self.algorithm.routing_replay!r} records routed experts in the "
                f"single-turn generate fn; the multi-turn rollout.agent_fn = {self.rollout.agent_fn!r} does not "
                "record them: set algorithm.routing_replay = 'off'")
        if self.eval.num_engines and self.eval.backend is not None:
            raise ValueError(
                f"eval.num_engines = {self.eval.num_engines} with eval.backend = {self.eval.backend!r}: an evaluation "
                "point is scored by the fleet or by the backend, not both; set eval.num_engines = 0 or remove "
                "eval.backend")
        if self.lora.adapters:
            from verst.config.adapters import check_adapters

            check_adapters(self)
        self._check_engine()
        check_colocated_broadcast(self)
        if self.reward.type == "custom" and not self.reward.path:
            raise ValueError("reward.type = 'custom' needs reward.path (an import path)")
        if self.reward.type == "remote" and not self.reward.url:
            raise ValueError("reward.type = 'remote' needs reward.url")
        return self

    def _check_engine(self) -> None:
        """What cluster.engine cannot do (a transport, LoRA, model.impl, another engine's flags), by name."""
        from verst.config.engines import config_problems

        problems = config_problems(self.cluster.engine, transport=self.sync.transport, lora=self.lora.enabled,
                                   model_impl=self.model.impl, flags={"vllm": self.vllm, "sglang": self.sglang},
                                   placement=self.cluster.placement)
        if problems:
            raise ValueError("; ".join(problems))
