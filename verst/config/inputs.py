"""What a run starts from and how it rolls out: the model, the prompts, sampling and rollout volume, the agent's
sandboxes, and the reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from verst.config.registries import GroupFilterSpec, RewardName, SandboxProviderName
from verst.config.section import ModelImpl, Section
from verst.types.sampling import SamplingKnobs


class ModelConfig(Section):
    path: str = Field("artifacts/models/tiny-qwen3", description="Hugging Face checkpoint directory (config, weights, "
                      "tokenizer); for kind = 'diffusion', a denoiser in diffusers' format.")
    kind: Literal["causal_lm", "diffusion"] = Field(
        "causal_lm", description="causal_lm: a language model; diffusion: a class-conditioned flow-matching denoiser "
        "(diffusers' UNet2DModel), sampled by cluster.engine = 'diffusion' and trained with Flow-GRPO "
        "(docs/diffusion.md).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype; float32 on CPU, bfloat16 on GPU."
    )
    trust_remote_code: bool = Field(False, description="Allow model code shipped inside the checkpoint directory.")
    impl: ModelImpl = Field(
        "auto", description="Model class of the embedded engines and the trainer: native (dense Llama-family, "
        "no transformers import), transformers, or auto (native where it applies; the trainer on CUDA: "
        "transformers, for flash attention and packed sequences).",
    )


class DiffusionConfig(Section):
    """model.kind = 'diffusion': the SDE sampler's settings, the same for the engines and the trainer's recomputed
    step log-probabilities (docs/diffusion.md)."""

    num_inference_steps: int = Field(10, ge=1, le=1000, description="Denoising steps from noise to image; each is "
                                     "one 'token' of the trajectory.")
    guidance_scale: float = Field(1.0, ge=0.0, le=100.0, description="Classifier-free guidance (1: none).")
    noise_level: float = Field(0.7, gt=0.0, le=10.0, description="The SDE's a: σ_t = a·√(t / (1 − t)).")
    eval_images_per_prompt: int = Field(4, ge=1, le=64, description="Held-out images per prompt at each evaluation, "
                                        "from fixed seeds; the report shows them as a grid.")


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
    dynamic_filter: GroupFilterSpec | None = Field(
        None, description="Group filter by name ('zero_std', DAPO) or import path; rejected groups are dropped."
    )
    rollout_fn: str | None = Field(None, description="Import path of a rollout fn (owns data, batching, rewards).")
    generate_fn: str | None = Field(None, description="Import path of a generate fn (owns one sample's generation).")
    agent_fn: str | None = Field(None, description="Import path of an agent fn (owns the episode loop).")
    submission_granularity: Literal["sample", "group"] = Field(
        "sample", description="Fully async: a finished sample (or only a whole group) frees its place."
    )
    request_per: Literal["sample", "group"] = Field(
        "sample", description="One /generate request per sample, or per group: the n_samples_per_prompt samples of a "
        "prompt in one request (SGLang's sampling_params.n), its prompt sent, routed and prefilled once and one "
        "connection and coroutine held for them all. 'group' needs the default generate fn, an engine that takes n, "
        "and in fully async submission_granularity = 'group'."
    )
    max_in_flight: int | None = Field(
        None, ge=1, description="Fully async: trajectories generating at once; default batch_size × n_samples_per_prompt."
    )
    admission: Literal["auto", "staleness", "fill"] = Field(
        "auto", description="Fully async: when a new group starts. fill: whenever max_in_flight has room; staleness: "
        "also only while it would be taken within buffer.max_staleness (no group is generated only to be dropped as "
        "stale); auto: staleness when buffer.max_staleness is set, else fill."
    )
    partial_rollout: bool = Field(
        False, description="A request a weight update aborted continues from its last token on the new weights "
        "(prompt + the output so far sent again, the rest of the token budget) instead of ending aborted; each "
        "response token keeps the version that sampled it (Sample.token_versions); the multi-turn and agentic generate "
        "fns continue a turn so. Needs sync.pause_mode = 'abort'.")
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


class SandboxConfig(Section):
    provider: SandboxProviderName | None = Field(
        None, description="Sandbox provider by name ('local': bubblewrap; 'daytona', 'e2b', 'modal'; or one a plug-in "
        "registers): each agent episode gets a workspace of its own, seeded with its task's files, passed to the "
        "agent fn as `sandbox`. Needs the agentic generate fn. None: no sandboxes.")
    lifetime: Literal["trajectory", "group", "run"] = Field(
        "trajectory", description="How long one sandbox lives: each trajectory its own; one per group, or one for "
        "the whole run, each trajectory then in a directory of its own inside it (fewer starts, no isolation "
        "between the trajectories that share it).")
    files_key: str = Field(
        "files", min_length=1, description="The sample metadata key holding the files (path to text) a trajectory's "
        "workspace starts from.")


class RewardConfig(Section):
    type: RewardName = Field(
        "numeric_match", description="A registered reward (`verst config docs` lists them), 'remote' (reward.url) or "
        "'custom' (reward.path).",
    )
    path: str | None = Field(None, description="Import path of a custom reward fn (type = 'custom').")
    url: str | None = Field(None, description="Remote reward endpoint (type = 'remote').")
    model_path: str | None = Field(None, description="The file of a reward that scores with a model of its own "
                                   "(shape_alignment: the classifier `verst diffusion classifier` trains).")
    timeout_s: float = Field(30.0, gt=0, description="Remote reward request timeout in seconds.")
    max_concurrency: int = Field(32, ge=1, description="Remote reward requests in flight at once.")
    group: bool = Field(False, description="Call the reward once per group with all its samples.")
    key: str | None = Field(None, description="Key that selects the scalar from a dict reward.")


