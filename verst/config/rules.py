"""Every rule that ties config fields together, one named function each, checked when a config loads (`RULES`,
in order; the core budget's in `core_rules`), plus the rules that need what the run finds at start-up (the device,
the placement) and the ones `verst sft` adds. A rule takes the sections it reads by name (`config`: the whole
tree) and raises `ValueError` naming each field and its value, and what would work instead."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from pydantic import ValidationError

from verst.config.adapters import adapter_run_config
from verst.config.arithmetic import batch_plan
from verst.config.core_rules import CORE_RULES
from verst.config.diffusion_rules import DIFFUSION_RULES
from verst.config.engine_rules import ENGINE_RULES, engines_with
from verst.config.inputs import ModelConfig, RewardConfig, RolloutConfig, SandboxConfig
from verst.config.parallel_rules import PARALLEL_RULES
from verst.config.registries import ADVANTAGE_ESTIMATORS, ENGINE_KINDS, NO_CORRECTION, WEIGHT_TRANSPORTS
from verst.config.runtime import (
    BufferConfig,
    CheckpointConfig,
    ClusterConfig,
    EvalConfig,
    FaultConfig,
    SyncConfig,
    TeacherConfig,
)
from verst.config.section import Section
from verst.config.training import AlgorithmConfig, CriticConfig, LoraConfig, TrainerConfig

MAX_ADAPTERS = 8  # the embedded engine's default --max-loaded-loras: every adapter stays resident
MULTI_LORA_SCHEDULES = ("sync", "fully_async")
# The generate fns that continue a request a weight update aborted (`rollout.partial_rollout`); None: the default.
AGENTIC_GENERATE_FN = "verst.rollout.agentic:generate"
# The default generate and rollout fns' import paths (the rollout side loads them from here).
DEFAULT_GENERATE_FN = "verst.rollout.generate:generate"
DEFAULT_ROLLOUT_FN = "verst.rollout.rollout_fn:rollout"
PARTIAL_ROLLOUT_GENERATE_FNS = (None, DEFAULT_GENERATE_FN, AGENTIC_GENERATE_FN,
                                "verst.rollout.multiturn:generate")


# ---- batch arithmetic ------------------------------------------------------------------------------
def _global_batch(rollout: RolloutConfig, trainer: TrainerConfig) -> tuple[int, int]:
    samples = rollout.batch_size * rollout.n_samples_per_prompt
    return samples, trainer.global_batch_size or samples


def rollout_divides_into_train_steps(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    samples, gbs = _global_batch(rollout, trainer)
    if samples % gbs:
        raise ValueError(
            f"rollout.batch_size × rollout.n_samples_per_prompt = {rollout.batch_size} × {rollout.n_samples_per_prompt} "
            f"= {samples} samples per rollout is not divisible by trainer.global_batch_size = {gbs}")


def train_steps_take_whole_groups(rollout: RolloutConfig, trainer: TrainerConfig) -> None:
    _, gbs = _global_batch(rollout, trainer)
    if gbs % rollout.n_samples_per_prompt:
        raise ValueError(f"trainer.global_batch_size = {gbs} is not a multiple of rollout.n_samples_per_prompt = "
                         f"{rollout.n_samples_per_prompt}: a train step consumes whole groups")


def train_steps_split_across_ranks(rollout: RolloutConfig, trainer: TrainerConfig, cluster: ClusterConfig) -> None:
    _, gbs = _global_batch(rollout, trainer)
    if gbs % cluster.trainer_ranks:
        raise ValueError(f"trainer.global_batch_size = {gbs} is not divisible by cluster.trainer_ranks = "
                         f"{cluster.trainer_ranks}")


def over_sampling_covers_the_batch(rollout: RolloutConfig) -> None:
    if rollout.over_sampling_batch_size is not None and rollout.over_sampling_batch_size < rollout.batch_size:
        raise ValueError(f"rollout.over_sampling_batch_size = {rollout.over_sampling_batch_size} is smaller than "
                         f"rollout.batch_size = {rollout.batch_size}")


def in_flight_holds_a_group(rollout: RolloutConfig) -> None:
    if rollout.max_in_flight is not None and rollout.max_in_flight < rollout.n_samples_per_prompt:
        raise ValueError(f"rollout.max_in_flight = {rollout.max_in_flight} cannot hold one group of "
                         f"rollout.n_samples_per_prompt = {rollout.n_samples_per_prompt}")


def context_leaves_room_for_a_prompt(rollout: RolloutConfig) -> None:
    if rollout.max_context_tokens is not None and rollout.max_context_tokens <= rollout.max_response_tokens:
        raise ValueError(f"rollout.max_context_tokens = {rollout.max_context_tokens} leaves no room for a prompt with "
                         f"rollout.max_response_tokens = {rollout.max_response_tokens}")


# ---- schedule and placement ------------------------------------------------------------------------
def fully_async_needs_disaggregated(schedule: str, cluster: ClusterConfig) -> None:
    if schedule == "fully_async" and cluster.placement == "colocated":
        raise ValueError("schedule = 'fully_async' with cluster.placement = 'colocated' is refused: the fully async "
                         "schedule needs trainer and engines running at once; use cluster.placement = 'disaggregated'")


def fully_async_calls_no_rollout_fn(schedule: str, rollout: RolloutConfig) -> None:
    if schedule == "fully_async" and rollout.rollout_fn:
        raise ValueError(
            f"rollout.rollout_fn = {rollout.rollout_fn!r} with schedule = 'fully_async' is refused: the fully async "
            "worker generates and scores samples itself (rollout.generate_fn and [reward]) and never calls a rollout "
            "fn; use schedule = 'sync' or 'one_step_off'")


def staleness_admission_needs_a_limit(rollout: RolloutConfig, buffer: BufferConfig) -> None:
    if rollout.admission == "staleness" and buffer.max_staleness is None:
        raise ValueError("rollout.admission = 'staleness' admits groups by the staleness limit, but "
                         "buffer.max_staleness = None sets none; set buffer.max_staleness or rollout.admission = 'auto'")


def staleness_admission_is_fully_async(schedule: str, rollout: RolloutConfig) -> None:
    if rollout.admission == "staleness" and schedule != "fully_async":
        raise ValueError(f"rollout.admission = 'staleness' paces the fully async worker, and schedule = {schedule!r} "
                         "runs none; use schedule = 'fully_async' or rollout.admission = 'auto'")


def partial_rollouts_abort_on_a_weight_update(rollout: RolloutConfig, sync: SyncConfig, cluster: ClusterConfig) -> None:
    if not rollout.partial_rollout:
        return
    if sync.pause_mode != "abort":
        raise ValueError(
            f"rollout.partial_rollout = true with sync.pause_mode = {sync.pause_mode!r} is refused: under retract or "
            "in_place the engines continue an interrupted request themselves and report only its oldest and newest "
            "weight version, so its tokens cannot each be given the version that sampled them; partial rollouts "
            "continue the requests a weight update aborted: set sync.pause_mode = 'abort'")
    if cluster.engine == "vllm":
        raise ValueError("rollout.partial_rollout = true with cluster.engine = 'vllm' is refused: the vLLM gateway's "
                         "aborted replies carry no output, so there is nothing to continue; use cluster.engine = "
                         "'embedded' or 'sglang'")
    if rollout.generate_fn not in PARTIAL_ROLLOUT_GENERATE_FNS:
        raise ValueError(
            f"rollout.partial_rollout = true with rollout.generate_fn = {rollout.generate_fn!r} is refused: a generate "
            f"fn owns its engine calls, and only {', '.join(g for g in PARTIAL_ROLLOUT_GENERATE_FNS if g)} (or the "
            "default, None) continue the ones a weight update aborted")


def group_requests_fit(schedule: str, rollout: RolloutConfig, cluster: ClusterConfig) -> None:
    if rollout.request_per != "group":
        return
    owners = {"rollout.generate_fn": (rollout.generate_fn, DEFAULT_GENERATE_FN, "one sample's generation"),
              "rollout.rollout_fn": (rollout.rollout_fn, DEFAULT_ROLLOUT_FN, "its engine calls")}
    for field, (value, default, owns) in owners.items():
        if value not in (None, default):
            raise ValueError(f"rollout.request_per = 'group' with {field} = {value!r} is refused: a group's samples go "
                             f"in one request of the default rollout and generate fns, and {field} owns {owns}; unset "
                             f"{field} or use rollout.request_per = 'sample'")
    if schedule == "fully_async" and rollout.submission_granularity != "group":
        raise ValueError(f"rollout.request_per = 'group' with schedule = 'fully_async' and rollout.submission_granularity "
                         f"= {rollout.submission_granularity!r} is refused: a group's one request ends when its last "
                         "sample does, so no sample frees its place before; set rollout.submission_granularity = 'group'")
    entry = ENGINE_KINDS.entry(cluster.engine)
    if not entry.samples_per_request:
        raise ValueError(f"rollout.request_per = 'group' with cluster.engine = {cluster.engine!r} is refused: it takes "
                         f"one sample per request (sampling_params.n = 1); use cluster.engine = "
                         f"{engines_with('samples_per_request')} or rollout.request_per = 'sample'")
    if rollout.sampling.seed is not None and not entry.seeds_each_sample:
        raise ValueError(f"rollout.request_per = 'group' with rollout.sampling.seed = {rollout.sampling.seed} and "
                         f"cluster.engine = {cluster.engine!r} is refused: that engine gives every sample of one request "
                         "the same sampling_seed, so a group's samples would all be alike; unset rollout.sampling.seed, "
                         f"use cluster.engine = {engines_with('seeds_each_sample')} or rollout.request_per = 'sample'")


def restarts_need_checkpoints(fault: FaultConfig, checkpoint: CheckpointConfig) -> None:
    if fault.max_restarts and not checkpoint.interval:
        raise ValueError(f"fault.max_restarts = {fault.max_restarts} restarts a run from its latest checkpoint, but "
                         "checkpoint.interval = 0 saves none before the end; set checkpoint.interval > 0")


# ---- the algorithm ---------------------------------------------------------------------------------
def mismatch_correction_needs_trainer_logprobs(algorithm: AlgorithmConfig) -> None:
    if algorithm.mismatch_correction != NO_CORRECTION and algorithm.old_logprobs == "rollout":
        raise ValueError(f"algorithm.mismatch_correction = {algorithm.mismatch_correction!r} corrects rollout vs "
                         "trainer logprobs; it cannot be combined with algorithm.old_logprobs = 'rollout'")


def mismatch_fn_replaces_the_correction(algorithm: AlgorithmConfig) -> None:
    if algorithm.mismatch_fn is None:
        return
    if algorithm.mismatch_correction != NO_CORRECTION:
        raise ValueError(f"algorithm.mismatch_fn = {algorithm.mismatch_fn!r} replaces algorithm.mismatch_correction = "
                         f"{algorithm.mismatch_correction!r}; set one of them")
    if algorithm.old_logprobs == "rollout":
        raise ValueError(f"algorithm.mismatch_fn = {algorithm.mismatch_fn!r} corrects rollout vs trainer logprobs; it "
                         "cannot be combined with algorithm.old_logprobs = 'rollout'")


def importance_weighted_kl_needs_a_kl_loss(algorithm: AlgorithmConfig) -> None:
    if algorithm.kl_importance_weighted and algorithm.kl_loss_coef == 0:
        raise ValueError("algorithm.kl_importance_weighted = true weights the KL loss, which is off: set "
                         "algorithm.kl_loss_coef > 0")


def kl_penalty_needs_a_token_level_estimator(algorithm: AlgorithmConfig) -> None:
    token_level = [name for name in ADVANTAGE_ESTIMATORS if ADVANTAGE_ESTIMATORS.entry(name).token_level]
    if algorithm.kl_penalty_coef > 0 and not ADVANTAGE_ESTIMATORS.entry(algorithm.advantage_estimator).token_level:
        raise ValueError(f"algorithm.kl_penalty_coef = {algorithm.kl_penalty_coef} needs a token-level estimator "
                         f"{tuple(token_level)}, got algorithm.advantage_estimator = {algorithm.advantage_estimator!r}")


def something_to_train_on(algorithm: AlgorithmConfig) -> None:
    if algorithm.reward_coef == 0 and algorithm.distill_coef == 0:
        raise ValueError("algorithm.reward_coef = 0 with algorithm.distill_coef = 0 leaves no training signal; set "
                         "algorithm.distill_coef > 0 (pure on-policy distillation) or algorithm.reward_coef > 0")


def mismatch_band_is_ordered(algorithm: AlgorithmConfig) -> None:
    if algorithm.tis_clip_low >= algorithm.tis_clip:
        raise ValueError(f"algorithm.tis_clip_low = {algorithm.tis_clip_low} must be < algorithm.tis_clip = "
                         f"{algorithm.tis_clip}")


def critic_settings_need_a_critic(algorithm: AlgorithmConfig, critic: CriticConfig) -> None:
    changed = [f"critic.{name}" for name, field in CriticConfig.model_fields.items()
               if getattr(critic, name) != field.default]
    if changed and not algorithm.needs_critic:
        raise ValueError(f"{', '.join(changed)} changed from the default, but algorithm.advantage_estimator = "
                         f"{algorithm.advantage_estimator!r} trains no value model; remove them or use one that does "
                         "(ppo)")


def distillation_needs_a_teacher(algorithm: AlgorithmConfig, teacher: TeacherConfig) -> None:
    if algorithm.distill_coef > 0 and teacher.model_path is None:
        raise ValueError(f"algorithm.distill_coef = {algorithm.distill_coef} needs a teacher's logprobs: set "
                         "teacher.model_path (the teacher's checkpoint directory), or algorithm.distill_coef = 0")


def a_teacher_needs_distillation(algorithm: AlgorithmConfig, teacher: TeacherConfig) -> None:
    if teacher.model_path is not None and algorithm.distill_coef == 0:
        raise ValueError(f"teacher.model_path = {teacher.model_path!r} with algorithm.distill_coef = 0: the teacher "
                         "would score every sample and train nothing; set algorithm.distill_coef > 0 or remove "
                         "teacher.model_path")


def true_on_policy_needs_one_forward(algorithm: AlgorithmConfig, model: ModelConfig, cluster: ClusterConfig,
                                     lora: LoraConfig) -> None:
    """`algorithm.true_on_policy` holds only where engine and trainer can run the same CPU float32 forward."""
    if not algorithm.true_on_policy:
        return
    engine = ENGINE_KINDS.entry(cluster.engine)
    refusals = {
        "model.dtype": (model.dtype, model.dtype != "float32", "float32"),
        "model.impl": (model.impl, model.impl == "transformers", "'native' or 'auto'"),
        "cluster.engine": (cluster.engine, not engine.true_on_policy, engines_with("true_on_policy")),
        "cluster.device": (cluster.device, cluster.device == "cuda", "'cpu' or 'auto'"),
        "lora.enabled": (lora.enabled, lora.enabled, "false"),
        "algorithm.routing_replay": (algorithm.routing_replay, algorithm.routing_replay != "off", "'off'"),
    }
    for field, (value, refused, needed) in refusals.items():
        if refused:
            raise ValueError(f"algorithm.true_on_policy = true needs {field} = {needed} (the engine and the trainer "
                             f"run the same CPU float32 native forward); got {field} = {value!r}")


def routing_replay_needs_routed_experts(algorithm: AlgorithmConfig, cluster: ClusterConfig,
                                        rollout: RolloutConfig) -> None:
    if algorithm.routing_replay == "off":
        return
    if not ENGINE_KINDS.entry(cluster.engine).routed_experts:
        raise ValueError(f"algorithm.routing_replay = {algorithm.routing_replay!r} needs engines that return routed "
                         f"experts on every reply; cluster.engine = {cluster.engine!r} is not wired for it, use "
                         f"{engines_with('routed_experts')}")
    if rollout.agent_fn:
        raise ValueError(f"algorithm.routing_replay = {algorithm.routing_replay!r} records routed experts in the "
                         f"single-turn generate fn; the multi-turn rollout.agent_fn = {rollout.agent_fn!r} does not "
                         "record them: set algorithm.routing_replay = 'off'")


def sandboxes_go_to_an_agent_fn(sandbox: SandboxConfig, rollout: RolloutConfig) -> None:
    if sandbox.provider is None:
        return
    if rollout.generate_fn != AGENTIC_GENERATE_FN or not rollout.agent_fn:
        raise ValueError(f"sandbox.provider = {sandbox.provider!r} hands each episode's sandbox to the agent fn: set "
                         f"rollout.generate_fn = {AGENTIC_GENERATE_FN!r} (it is {rollout.generate_fn!r}) and "
                         f"rollout.agent_fn (it is {rollout.agent_fn!r})")


def eval_fleet_or_backend(eval: EvalConfig) -> None:
    if eval.num_engines and eval.backend is not None:
        raise ValueError(f"eval.num_engines = {eval.num_engines} with eval.backend = {eval.backend!r}: an evaluation "
                         "point is scored by the fleet or by the backend, not both; set eval.num_engines = 0 or remove "
                         "eval.backend")


# ---- rewards ---------------------------------------------------------------------------------------
def reward_source_has_its_setting(reward: RewardConfig) -> None:
    if reward.type == "custom" and not reward.path:
        raise ValueError("reward.type = 'custom' needs reward.path (an import path to an async fn)")
    if reward.type == "remote" and not reward.url:
        raise ValueError("reward.type = 'remote' needs reward.url")
    if reward.path is not None and reward.type != "custom":
        raise ValueError(f"reward.path = {reward.path!r} is set but reward.type = {reward.type!r}; use type 'custom'")
    if reward.url is not None and reward.type != "remote":
        raise ValueError(f"reward.url = {reward.url!r} is set but reward.type = {reward.type!r}; use type 'remote'")


def group_rewards_need_a_group_fn(reward: RewardConfig) -> None:
    if reward.group and reward.type != "custom":
        raise ValueError(f"reward.group = true needs a custom group fn; reward.type = {reward.type!r} scores one "
                         "sample")


# ---- multi-LoRA ------------------------------------------------------------------------------------
def adapters_train_with_lora(lora: LoraConfig) -> None:
    names = [adapter.name for adapter in lora.adapters]
    if not names:
        return
    if not lora.enabled:
        raise ValueError(f"lora.adapters names {names} but lora.enabled = false; set lora.enabled = true")
    if lora.sync != "adapter":
        raise ValueError(f"lora.adapters (multi-LoRA) with lora.sync = {lora.sync!r}: the engines serve every adapter "
                         "by name on their base; use lora.sync = 'adapter'")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"lora.adapters: the names {duplicates} appear more than once; each adapter needs its own name")
    if len(names) > MAX_ADAPTERS:
        raise ValueError(f"lora.adapters holds {len(names)} adapters; the engines keep at most {MAX_ADAPTERS} resident "
                         "(--max-loaded-loras)")
    for index, adapter in enumerate(lora.adapters):
        if isinstance(adapter.target_modules, list) and not [m for m in adapter.target_modules if m.strip()]:
            raise ValueError(f"lora.adapters[{index}].target_modules = {adapter.target_modules} names no module")


def adapters_on_a_multi_lora_schedule(schedule: str, lora: LoraConfig, sync: SyncConfig) -> None:
    if not lora.adapters:
        return
    if schedule not in MULTI_LORA_SCHEDULES:
        raise ValueError(f"lora.adapters (multi-LoRA) with schedule = {schedule!r}: multi-LoRA runs on the schedules "
                         f"{MULTI_LORA_SCHEDULES}")
    if sync.interval != 1:
        raise ValueError(f"sync.interval = {sync.interval} with lora.adapters: each adapter's step is pushed under its "
                         "own name right after it; use sync.interval = 1")


def adapters_train_one_policy_each(lora: LoraConfig, algorithm: AlgorithmConfig, teacher: TeacherConfig,
                                   checkpoint: CheckpointConfig, eval: EvalConfig) -> None:
    if not lora.adapters:
        return
    if checkpoint.merge_lora:
        raise ValueError("checkpoint.merge_lora = true with lora.adapters: a merged model holds one adapter; export the "
                         "adapters (hf/<name>) and merge the one you need")
    if eval.backend is not None:
        raise ValueError(f"eval.backend = {eval.backend!r} with lora.adapters: evaluation snapshots hold one policy; "
                         "multi-LoRA runs evaluate each adapter on the rollout engines")
    if eval.num_engines:
        raise ValueError(f"eval.num_engines = {eval.num_engines} with lora.adapters: the evaluation fleet serves one "
                         "policy's snapshot; multi-LoRA runs evaluate each adapter on the rollout engines "
                         "(eval.num_engines = 0)")
    if algorithm.needs_critic:
        raise ValueError(f"algorithm.advantage_estimator = {algorithm.advantage_estimator!r} with lora.adapters: one "
                         "critic would fit every adapter's task at once; multi-LoRA runs take the critic-free "
                         "estimators (grpo, rloo, ...)")
    if teacher.model_path is not None:
        raise ValueError(f"teacher.model_path = {teacher.model_path!r} with lora.adapters: on-policy distillation "
                         "trains one policy; remove teacher.model_path or lora.adapters")


def every_adapter_is_a_valid_run(config: Section) -> None:
    """Each adapter's run config (`adapter_run_config`) passes every rule; the sync schedule interleaves the
    adapters one optimizer step per rollout batch."""
    lora = config.lora  # type: ignore[attr-defined]
    for index, adapter in enumerate(lora.adapters):
        try:
            own = adapter_run_config(config, adapter.name)
        except ValidationError as error:
            problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in error.errors())
            raise ValueError(f"lora.adapters[{index}] ({adapter.name!r}): {problems}") from None
        steps = batch_plan(own).train_steps_per_rollout
        if config.schedule == "sync" and steps != 1:  # type: ignore[attr-defined]
            raise ValueError(f"lora.adapters[{index}] ({adapter.name!r}): {steps} optimizer steps per rollout batch; "
                             "the sync schedule interleaves adapters one step per rollout batch: set its "
                             "global_batch_size to its batch_size x n_samples_per_prompt")


RULES: tuple[Callable[..., None], ...] = (
    rollout_divides_into_train_steps, train_steps_take_whole_groups, train_steps_split_across_ranks,
    *PARALLEL_RULES, *DIFFUSION_RULES,
    over_sampling_covers_the_batch, in_flight_holds_a_group, context_leaves_room_for_a_prompt,
    fully_async_needs_disaggregated, fully_async_calls_no_rollout_fn, staleness_admission_needs_a_limit,
    staleness_admission_is_fully_async, partial_rollouts_abort_on_a_weight_update, group_requests_fit,
    restarts_need_checkpoints,
    mismatch_correction_needs_trainer_logprobs, mismatch_fn_replaces_the_correction,
    importance_weighted_kl_needs_a_kl_loss, kl_penalty_needs_a_token_level_estimator, something_to_train_on,
    mismatch_band_is_ordered, critic_settings_need_a_critic, distillation_needs_a_teacher,
    a_teacher_needs_distillation, true_on_policy_needs_one_forward, routing_replay_needs_routed_experts,
    sandboxes_go_to_an_agent_fn, *ENGINE_RULES,
    eval_fleet_or_backend, reward_source_has_its_setting, group_rewards_need_a_group_fn, adapters_train_with_lora,
    adapters_on_a_multi_lora_schedule, adapters_train_one_policy_each, every_adapter_is_a_valid_run, *CORE_RULES,
)


def check_rules(config: Section, rules: tuple[Callable[..., None], ...] = RULES) -> None:
    """Every rule over `config`, in order, each given the sections it names; the first broken one raises."""
    for rule in rules:
        rule(**{name: config if name == "config" else getattr(config, name) for name in _parameters(rule)})


@functools.cache
def _parameters(rule: Callable[..., None]) -> tuple[str, ...]:
    return tuple(inspect.signature(rule).parameters)


# ---- rules of what the run finds at start-up, and of `verst sft` --------------------------------------
def true_on_policy_on_the_cpu(algorithm: AlgorithmConfig, device: str) -> None:
    """`cluster.device = 'auto'` resolved to `device` by the orchestration."""
    if algorithm.true_on_policy and device == "cuda":
        raise ValueError("algorithm.true_on_policy = true holds on the CPU only (float32 CPU kernels on both sides); "
                         "cluster.device = 'auto' chose cuda here: set cluster.device = 'cpu'")


def transport_reaches_the_engines(transport: str, trainer_host: str | None, engine_hosts: list[str | None]) -> None:
    """A transport that hands weights over in memory needs every engine on trainer rank 0's machine."""
    if not WEIGHT_TRANSPORTS.entry(transport).same_machine:
        return
    apart = [index for index, host in enumerate(engine_hosts) if host != trainer_host]
    if apart:
        raise ValueError(
            f"sync.transport = {transport!r} hands weights over in memory on one machine, but engine(s) {apart} were "
            f"placed on {sorted({str(engine_hosts[i]) for i in apart})}, not on trainer rank 0's {trainer_host}; use "
            "a transport that crosses machines: " + ", ".join(
                repr(name) for name in WEIGHT_TRANSPORTS if not WEIGHT_TRANSPORTS.entry(name).same_machine))


def sft_trains_one_policy(lora: LoraConfig, eval: EvalConfig) -> None:
    if lora.adapters:
        raise ValueError(f"lora.adapters ({[a.name for a in lora.adapters]}): multi-LoRA trains with RL only; SFT "
                         "trains one adapter (lora.enabled = true without lora.adapters)")
    if eval.num_engines:
        raise ValueError(f"eval.num_engines = {eval.num_engines}: the evaluation fleet scores RL runs; SFT evaluates "
                         "with the trainer's model (set eval.num_engines = 0)")


def sft_trains_a_language_model(model: ModelConfig) -> None:
    if model.kind != "causal_lm":
        raise ValueError(f"model.kind = {model.kind!r}: SFT trains language models on text; a diffusion model trains "
                         "with RL (`verst train`, docs/diffusion.md) or `verst diffusion pretrain`")


SFT_RULES: tuple[Callable[..., None], ...] = (sft_trains_one_policy, sft_trains_a_language_model)


def check_sft_rules(config: Section) -> None:
    check_rules(config, SFT_RULES)
