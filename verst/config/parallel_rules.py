"""The rules of the trainer's parallelism (`trainer.tensor_parallel_size`, `trainer.sequence_parallel`,
`trainer.expert_parallel_size`, `trainer.context_parallel_size`): part of `verst.config.rules.RULES`. What a plan cannot split is refused here by name; what only the checkpoint tells
(its class, its head and expert counts) is refused when the model is built.
"""

from __future__ import annotations

from verst.config.inputs import ModelConfig
from verst.config.runtime import ClusterConfig
from verst.config.training import AlgorithmConfig, LoraConfig, TrainerConfig


def tensor_parallel_divides_the_ranks(trainer: TrainerConfig, cluster: ClusterConfig) -> None:
    tp = trainer.tensor_parallel_size
    if cluster.trainer_ranks % tp:
        raise ValueError(f"trainer.tensor_parallel_size = {tp} does not divide cluster.trainer_ranks = "
                         f"{cluster.trainer_ranks}: the ranks form a data-parallel x tensor-parallel mesh")


def tensor_parallel_has_a_plan(trainer: TrainerConfig, lora: LoraConfig, algorithm: AlgorithmConfig) -> None:
    """The tensor-parallel plan is written for the dense Llama / Qwen families (verst's native model or
    transformers'), whole weights trained, one policy; a checkpoint of another class is refused when built."""
    tp = trainer.tensor_parallel_size
    if tp == 1:
        return
    if algorithm.routing_replay != "off":
        raise ValueError(f"trainer.tensor_parallel_size = {tp} cannot combine with algorithm.routing_replay = "
                         f"{algorithm.routing_replay!r}: the plan is for dense models, not MoE")
    if lora.enabled:
        raise ValueError(f"trainer.tensor_parallel_size = {tp} cannot combine with lora.enabled = true: the plan "
                         "shards the base layers PEFT wraps")
    if algorithm.true_on_policy:
        raise ValueError(f"trainer.tensor_parallel_size = {tp} cannot combine with algorithm.true_on_policy = true: "
                         "split matmuls sum in another order than the engine's single forward")
    if algorithm.needs_critic:
        raise ValueError(f"trainer.tensor_parallel_size = {tp} cannot combine with algorithm.advantage_estimator = "
                         f"{algorithm.advantage_estimator!r}: the critic's value head has no tensor-parallel plan")


def expert_parallel_divides_the_ranks(trainer: TrainerConfig, cluster: ClusterConfig) -> None:
    ep = trainer.expert_parallel_size
    if cluster.trainer_ranks % ep:
        raise ValueError(f"trainer.expert_parallel_size = {ep} does not divide cluster.trainer_ranks = "
                         f"{cluster.trainer_ranks}: the ranks form a data-parallel x expert-parallel mesh for the experts")


def expert_parallel_has_a_plan(trainer: TrainerConfig, model: ModelConfig, lora: LoraConfig,
                               algorithm: AlgorithmConfig) -> None:
    """The expert-parallel plan is written for transformers' Qwen3-MoE, whole weights trained, one policy; a
    checkpoint of another class, or whose experts the size does not divide, is refused when built."""
    ep = trainer.expert_parallel_size
    if ep == 1:
        return
    # field = value as the message shows it: (refused, why)
    refusals = {
        f"trainer.tensor_parallel_size = {trainer.tensor_parallel_size}": (
            trainer.tensor_parallel_size > 1, "the experts' plan is not written for a tensor-parallel mesh"),
        f"model.impl = {model.impl!r}": (model.impl == "native", "verst's native model is dense"),
        "lora.enabled = true": (lora.enabled, "the plan replaces the experts modules PEFT would wrap"),
        "algorithm.true_on_policy = true": (algorithm.true_on_policy,
                                            "each expert's matmul runs over other tokens than the engine's"),
        f"algorithm.advantage_estimator = {algorithm.advantage_estimator!r}": (
            algorithm.needs_critic, "the critic's value head has no expert-parallel plan"),
    }
    _refuse_combinations(f"trainer.expert_parallel_size = {ep}", refusals)


def context_parallel_divides_the_ranks(trainer: TrainerConfig, cluster: ClusterConfig) -> None:
    cp = trainer.context_parallel_size
    if cluster.trainer_ranks % cp:
        raise ValueError(f"trainer.context_parallel_size = {cp} does not divide cluster.trainer_ranks = "
                         f"{cluster.trainer_ranks}: the ranks form a data-parallel x context-parallel mesh")


def context_parallel_has_a_plan(trainer: TrainerConfig, model: ModelConfig, lora: LoraConfig,
                                algorithm: AlgorithmConfig) -> None:
    """Context parallelism is written in verst's native model's attention (dense Llama / Qwen families), whole
    weights trained, one policy, no other model-parallel axis; a checkpoint the native class does not cover is
    refused at start-up (preflight)."""
    cp = trainer.context_parallel_size
    if cp == 1:
        return
    # field = value as the message shows it: (refused, why)
    refusals = {
        f"trainer.tensor_parallel_size = {trainer.tensor_parallel_size}": (
            trainer.tensor_parallel_size > 1, "the mesh has no third axis for tensor-parallel heads"),
        f"trainer.expert_parallel_size = {trainer.expert_parallel_size}": (
            trainer.expert_parallel_size > 1, "the native model is dense"),
        f"model.impl = {model.impl!r}": (model.impl == "transformers",
                                         "the keys and values are gathered in verst's native attention"),
        f"algorithm.routing_replay = {algorithm.routing_replay!r}": (algorithm.routing_replay != "off",
                                                                      "the native model is dense, not MoE"),
        "lora.enabled = true": (lora.enabled, "not proven with PEFT's wrapped model"),
        "algorithm.true_on_policy = true": (algorithm.true_on_policy,
                                            "a split row's attention sums in another order than the engine's"),
        f"algorithm.advantage_estimator = {algorithm.advantage_estimator!r}": (
            algorithm.needs_critic, "the critic's value head has no context-parallel forward"),
    }
    _refuse_combinations(f"trainer.context_parallel_size = {cp}", refusals)


def _refuse_combinations(layout: str, refusals: dict[str, tuple[bool, str]]) -> None:
    """`layout` ("field = value") refused with the first setting of `refusals` (the setting as the message shows
    it: (whether it is set, why they cannot combine)) that is set."""
    for setting, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"{layout} cannot combine with {setting}: {why}")


def sequence_parallel_has_a_plan(trainer: TrainerConfig) -> None:
    """Sequence parallelism splits the residual stream between tensor-parallel regions over the same ranks."""
    if trainer.sequence_parallel and trainer.tensor_parallel_size == 1:
        raise ValueError("trainer.sequence_parallel = true needs trainer.tensor_parallel_size > 1: the positions are "
                         "split over the tensor-parallel ranks")


PARALLEL_RULES = (tensor_parallel_divides_the_ranks, tensor_parallel_has_a_plan, expert_parallel_divides_the_ranks,
                  expert_parallel_has_a_plan, context_parallel_divides_the_ranks, context_parallel_has_a_plan,
                  sequence_parallel_has_a_plan)
