"""How a run learns: advantages and losses, the optimizer and batching, LoRA, PPO's critic, and SFT."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from verst.config.inputs import DataConfig, RewardConfig
from verst.config.registries import ADVANTAGE_ESTIMATORS, CorrectionName, EstimatorName, PolicyLossName
from verst.config.section import Section

# How per-token losses reduce to one number (verst.algo.aggregation), and the KL estimators (verst.algo.kl).
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]


class AlgorithmConfig(Section):
    advantage_estimator: EstimatorName = Field(
        "grpo", description="How rewards become per-token advantages: a registered estimator (grpo, dr_grpo, rloo, "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, ppo, or one of yours).")
    grpo_std_normalization: bool = Field(True, description="GRPO: divide by the group std (off = Dr.GRPO style).")
    policy_loss: PolicyLossName = Field(
        "ppo_clip", description="A registered per-token policy loss: ppo_clip (token-level PPO clip), gspo "
        "(sequence-level), or one of yours.")
    eps_clip: float = Field(0.2, gt=0, description="Lower clip range of the importance ratio.")
    eps_clip_high: float | None = Field(None, gt=0, description="Upper clip range (clip-higher); default eps_clip.")
    dual_clip_c: float | None = Field(None, gt=1, description="Dual-clip constant for negative advantages; None disables.")
    loss_aggregation: LossAggregation = Field(
        "token_mean", description="How per-token losses reduce to one number."
    )
    kl_loss_coef: float = Field(0.0, ge=0, description="Weight of the KL-to-reference loss (needs a reference model).")
    kl_penalty_coef: float = Field(0.0, ge=0, description="REINFORCE++: token-level KL penalty folded into rewards.")
    kl_estimator: KLEstimator = Field("k3", description="KL estimator.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (REINFORCE++, GAE).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    value_clip: float = Field(0.2, gt=0, description="PPO value-loss clip range.")
    whiten_advantages: bool = Field(
        False, description="Whiten the advantages of every estimator: (A − mean) / std over the step's policy tokens."
    )
    mismatch_correction: CorrectionName = Field(
        "none", description="Train–inference mismatch correction from rollout logprobs, a registered one: tis "
        "(truncated weight), mis_token (weight ρ inside the band, 0 outside; icepop is the same), mis_sequence, "
        "mis_geometric, band_mask (a 0/1 band mask, no reweighting); none: off.",
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
    max_token_staleness: int | None = Field(
        None, ge=0, description="Reject (weight 0 in the policy loss) policy tokens sampled by weights more than this "
        "many versions older than the trainer's (per token: Sample.token_versions, else the sample's oldest "
        "version); None rejects none. The token staleness metrics are logged either way.",
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
        """The estimator reads a value model's per-token values (PPO's GAE)."""
        return ADVANTAGE_ESTIMATORS.entry(self.advantage_estimator).needs_critic


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
    tensor_parallel_size: int = Field(
        1, ge=1, description="Trainer ranks that split each layer's weights (tensor parallel, dense Llama/Qwen models); "
        "the other factor of cluster.trainer_ranks is FSDP2's data-parallel axis (docs/parallelism.md).",
    )
    sequence_parallel: bool = Field(
        False, description="With tensor_parallel_size > 1: hold the residual stream and run the norms on "
        "1 / tensor_parallel_size of every row's positions between attention and the MLP, gathered entering each and "
        "reduce-scattered leaving it (Megatron's sequence parallelism; docs/parallelism.md).",
    )
    expert_parallel_size: int = Field(
        1, ge=1, description="Trainer ranks that split each MoE layer's experts and exchange tokens by all-to-all "
        "(expert parallel, Qwen3-MoE); each stays a data-parallel rank with its own micro-batches (docs/parallelism.md).",
    )
    context_parallel_size: int = Field(
        1, ge=1, description="Trainer ranks that split each row's tokens (context parallel, verst's native model): "
        "each holds 2 of its 2 x size chunks and attends to the keys and values gathered from the others; the other "
        "factor of cluster.trainer_ranks is data-parallel (docs/parallelism.md).",
    )
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


