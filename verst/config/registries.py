"""The built-in names of every registry, in one visible place: advantage estimators, policy losses, mismatch
corrections, rewards, engine kinds, weight transports, group filters and sandbox providers. Each name is written
here once, with the import path of what it stands for and the traits the config's rules and the run read;
nothing here imports torch.

Add your own with `register` (e.g. `ADVANTAGE_ESTIMATORS.register("my_baseline")(fn)`, re-exported by
`verst.algo`, `verst.rewards` and `verst.sync`) in a module that the config's `plugins` lists.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from pydantic import AfterValidator

from verst.config.registry import Entry, Registry


@dataclasses.dataclass(frozen=True)
class EstimatorEntry(Entry):
    """`fn(cfg, rewards, group_ids, loss_mask, *, kl, values) -> (advantages, returns | None)`."""

    token_level: bool = False  # folds algorithm.kl_penalty_coef into per-token rewards
    needs_critic: bool = False  # needs PPO's value model (critic values per token)


@dataclasses.dataclass(frozen=True)
class CorrectionEntry(Entry):
    """`fn(old_logprobs, rollout_logprobs, loss_mask, *, clip_low, clip_high) -> (weights, flags)`."""

    ratio: str = "token"  # the ratio it tests, which train/mismatch_ratio_* reports: token, sequence, geometric
    flags_metric: str = "train/mis_reject_frac"  # the metric that counts its flagged tokens


@dataclasses.dataclass(frozen=True)
class EngineEntry(Entry):
    """An inference engine kind (`verst.engine_kinds.EngineKind`) and what a run may ask of it."""

    transports: tuple[str, ...] = ()  # the sync.transport values it takes
    transport_note: str = ""  # why it takes no others
    lora: bool = False  # loads LoRA adapters
    lora_flag: str | None = None  # the server flag its adapters need at start-up
    adapter_tensors: bool = False  # loads an adapter from pushed tensors (not only from a directory)
    releases_memory: bool = False  # gives its device memory to a colocated trainer while it steps
    memory_flag: str | None = None  # the server flag its memory release needs at start-up
    cuda_ipc: bool = False  # takes weights as CUDA-IPC handles (the tensor transport on CUDA)
    routed_experts: bool = False  # returns the routed experts of every token (algorithm.routing_replay)
    true_on_policy: bool = False  # scores with the trainer's own per-sequence forward (algorithm.true_on_policy)
    model_impl: bool = False  # runs verst's model classes (model.impl chooses one)
    cpu_share: bool = False  # on CPU, takes its cores and torch threads from the run (cluster.cores), also mid-run
    flags_table: str | None = None  # its pass-through table of server flags ([vllm], [sglang])
    owned_flags: tuple[str, ...] = ()  # server flags verst sets from its own config, refused in the table
    images: bool = False  # serves a diffusion model (model.kind = "diffusion"): images, not tokens
    samples_per_request: bool = False  # takes sampling_params.n > 1 on /generate (rollout.request_per = "group")
    seeds_each_sample: bool = False  # with n > 1 and sampling_seed s, seeds sample i with s + i (not all alike)


@dataclasses.dataclass(frozen=True)
class TransportEntry(Entry):
    """A weight transport class (`verst.sync.WeightTransport`) and what it needs and leaves behind."""

    same_machine: bool = False  # hands weights over in memory: every engine on trainer rank 0's machine
    keeps_snapshots: bool = False  # every push leaves a Hugging Face snapshot of its version in RUN/weights
    one_gpu: bool = True  # works with a trainer rank and an engine on one GPU (NCCL refuses two ranks there)


@dataclasses.dataclass(frozen=True)
class RewardEntry(Entry):
    """A reward fn `async (sample) -> float | dict`; with `takes_model`, a factory `(reward.model_path) -> that fn`."""

    takes_model: bool = False  # built from the file reward.model_path names (a reward model, a classifier)
    images: bool = False  # scores images (model.kind = "diffusion")
    keys: tuple[str, ...] = ()  # a dict reward's keys, one of which reward.key selects


ADVANTAGE_ESTIMATORS: Registry[EstimatorEntry] = Registry("algorithm.advantage_estimator", EstimatorEntry)
POLICY_LOSSES: Registry[Entry] = Registry("algorithm.policy_loss")
MISMATCH_CORRECTIONS: Registry[CorrectionEntry] = Registry("algorithm.mismatch_correction", CorrectionEntry)
REWARDS: Registry[RewardEntry] = Registry("reward.type", RewardEntry)
ENGINE_KINDS: Registry[EngineEntry] = Registry("cluster.engine", EngineEntry)
WEIGHT_TRANSPORTS: Registry[TransportEntry] = Registry("sync.transport", TransportEntry)
GROUP_FILTERS: Registry[Entry] = Registry("rollout.dynamic_filter")
SANDBOX_PROVIDERS: Registry[Entry] = Registry("sandbox.provider")  # each a class or factory: (**options) -> provider
REGISTRIES = (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, MISMATCH_CORRECTIONS, REWARDS, ENGINE_KINDS, WEIGHT_TRANSPORTS,
              GROUP_FILTERS, SANDBOX_PROVIDERS)

_ADV = "verst.algo.advantages"
for _name, _doc, _traits in (
    ("grpo", "group-relative: (r − group mean) / group std (std with algorithm.grpo_std_normalization)", {}),
    ("dr_grpo", "Dr. GRPO: r − group mean, no std division", {}),
    ("rloo", "leave-one-out: r − mean of the group's other rewards", {}),
    ("reinforce_plus_plus", "REINFORCE++: discounted token returns, whitened over the batch", {"token_level": True}),
    ("reinforce_plus_plus_baseline", "REINFORCE++ on group-centred rewards", {"token_level": True}),
    ("ppo", "GAE over a learned value model (PPO's critic)", {"token_level": True, "needs_critic": True}),
):
    ADVANTAGE_ESTIMATORS.add(_name, EstimatorEntry(f"{_ADV}:{_name}_advantages", _doc, **_traits))

POLICY_LOSSES.add("ppo_clip", Entry("verst.algo.policy_loss:ppo_clip_token_loss",
                                    "token-level PPO clip (with clip-higher and dual clip)"))
POLICY_LOSSES.add("gspo", Entry("verst.algo.policy_loss:gspo_token_loss",
                                "GSPO: the PPO clip on the sequence's length-normalised ratio"))
POLICY_LOSSES.add("flow_grpo", Entry("verst.algo.flow_grpo:flow_grpo_token_loss",
                                     "Flow-GRPO: the PPO clip on each denoising step's ratio (steps as tokens)"))

_MIS = "verst.algo.mismatch"
for _name, _doc, _traits in (
    ("tis", "truncated importance weight clip(ρ_t, low, high)", {"flags_metric": "train/tis_clipfrac"}),
    ("mis_token", "masked importance sampling: ρ_t inside the band, 0 outside", {}),
    ("icepop", "IcePop's M(ρ_t): ρ_t on [low, high], 0 elsewhere (mis_token's computation)", {}),
    ("mis_sequence", "the band test and weight on the sequence ratio Π_t ρ_t", {"ratio": "sequence"}),
    ("mis_geometric", "the band test and weight on the geometric-mean ratio", {"ratio": "geometric"}),
    ("band_mask", "the token band as a 0/1 mask, no reweighting", {}),
):
    MISMATCH_CORRECTIONS.add(_name, CorrectionEntry(f"{_MIS}:{_name}_correction", _doc, **_traits))

for _name, _doc in (
    ("exact_match", "1 when the response equals a label (after trimming), else 0"),
    ("numeric_match", "1 when the response's last number equals a label's, else 0"),
    ("math_verify", "1 when math-verify finds the response's answer equal to a label's, else 0"),
    ("token_f1", "SQuAD-style token F1 between the response and the best-matching label"),
):
    REWARDS.add(_name, RewardEntry(f"verst.rewards.builtin:{_name}", _doc))
REWARDS.add("shape_alignment", RewardEntry(
    "verst.rewards.image:shape_alignment", "images: the shapes classifier (reward.model_path) on the prompt's class: "
    "'alignment' its probability, 'correct' 1 when it is the classifier's choice", takes_model=True, images=True,
    keys=("alignment", "correct")))
REWARDS.add("jpeg_compressibility", RewardEntry(
    "verst.rewards.image:jpeg_reward", "images: minus the JPEG size in kB (DDPO's compressibility)", images=True))

_KINDS = "verst.engine_kinds.kinds"
ENGINE_KINDS.add("embedded", EngineEntry(
    f"{_KINDS}:EMBEDDED", "verst's own engine (PyTorch, continuous batching, prefix cache)",
    transports=("distributed", "tensor", "disk"), lora=True, adapter_tensors=True, releases_memory=True,
    cuda_ipc=True, routed_experts=True, true_on_policy=True, model_impl=True, cpu_share=True, samples_per_request=True,
    seeds_each_sample=True))
ENGINE_KINDS.add("vllm", EngineEntry(
    f"{_KINDS}:VLLM", "vLLM behind verst's gateway (its own environment, `make vllm`)",
    transports=("disk",), transport_note="vLLM takes new weights from disk here (collective_rpc reload_weights); its "
    "weight-transfer API broadcasts over NCCL, which its CPU build does not have",
    flags_table="vllm", owned_flags=("model", "host", "port", "dtype")))
ENGINE_KINDS.add("sglang", EngineEntry(
    f"{_KINDS}:SGLANG", "an SGLang server, launched as it is (CUDA)",
    transports=("distributed", "tensor", "disk"), lora=True, lora_flag="enable-lora", releases_memory=True,
    memory_flag="enable-memory-saver", cuda_ipc=True, routed_experts=True, flags_table="sglang",
    owned_flags=("model-path", "host", "port", "dtype", "weight-version"), samples_per_request=True))

ENGINE_KINDS.add("diffusion", EngineEntry(
    f"{_KINDS}:DIFFUSION", "verst's diffusion engine: a denoiser's images with each denoising step's log-probability",
    transports=("distributed", "tensor", "disk"), images=True, cpu_share=True))

WEIGHT_TRANSPORTS.add("distributed", TransportEntry(
    "verst.sync.distributed:DistributedTransport", "a process-group broadcast from trainer rank 0 (gloo; NCCL "
    "on GPU)", one_gpu=False))
WEIGHT_TRANSPORTS.add("tensor", TransportEntry(
    "verst.sync.tensor:TensorTransport", "in memory on one machine (shared memory; CUDA IPC on GPU)",
    same_machine=True))
WEIGHT_TRANSPORTS.add("disk", TransportEntry(
    "verst.sync.disk:DiskTransport", "safetensors snapshots the engines load from disk", keeps_snapshots=True))

GROUP_FILTERS.add("zero_std", Entry(
    "verst.rollout.filters:ZeroStdFilter", "drop groups whose rewards all agree (DAPO's dynamic sampling)"))

SANDBOX_PROVIDERS.add("local", Entry("verst.sandbox.local:BubblewrapProvider",
                                     "bubblewrap on this machine (extra: sandbox)"))
SANDBOX_PROVIDERS.add("daytona", Entry("verst.sandbox.cloud.daytona:DaytonaProvider",
                                       "Daytona's cloud sandboxes (extra: daytona; DAYTONA_API_KEY)"))
SANDBOX_PROVIDERS.add("e2b", Entry("verst.sandbox.cloud.e2b:E2BProvider",
                                   "E2B's cloud sandboxes (extra: e2b; E2B_API_KEY)"))
SANDBOX_PROVIDERS.add("modal", Entry("verst.sandbox.cloud.modal:ModalProvider",
                                     "Modal's cloud sandboxes (extra: modal; MODAL_TOKEN_ID, MODAL_TOKEN_SECRET)"))

# The config fields that name an entry: a string checked against the registry when the config loads.
EstimatorName = Annotated[str, AfterValidator(ADVANTAGE_ESTIMATORS.check)]
PolicyLossName = Annotated[str, AfterValidator(POLICY_LOSSES.check)]
EngineKindName = Annotated[str, AfterValidator(ENGINE_KINDS.check)]
TransportName = Annotated[str, AfterValidator(WEIGHT_TRANSPORTS.check)]
SandboxProviderName = Annotated[str, AfterValidator(SANDBOX_PROVIDERS.check)]
NO_CORRECTION = "none"  # algorithm.mismatch_correction's off value
REWARD_SOURCES = ("remote", "custom")  # reward.type besides the registered rewards: reward.url, reward.path


def _correction(name: str) -> str:
    return name if name == NO_CORRECTION else MISMATCH_CORRECTIONS.check(name)


def _reward(name: str) -> str:
    if name in REWARD_SOURCES or name in REWARDS:
        return name
    raise ValueError(f"{REWARDS.unknown(name)}; or 'remote' (with reward.url) or 'custom' (with reward.path)")


def _group_filter(spec: str) -> str:
    """A registered filter's name, or an import path (`module:attr` or `module.attr`), imported at start-up."""
    return spec if "." in spec or ":" in spec else GROUP_FILTERS.check(spec)


CorrectionName = Annotated[str, AfterValidator(_correction)]
GroupFilterSpec = Annotated[str, AfterValidator(_group_filter)]
RewardName = Annotated[str, AfterValidator(_reward)]
