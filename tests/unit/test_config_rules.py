"""Every cross-field rule of the config (`verst.config.rules`), each broken once: the config is refused at load
with a message naming the fields and their values; a rule added without a case here fails the first test. And
config loading never imports torch, for every recipe and every `cluster.device` and `sync.transport`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from verst.config import ConfigError, load_config
from verst.config.core_rules import cores_exist
from verst.config.registries import ENGINE_KINDS, WEIGHT_TRANSPORTS
from verst.config.rules import (
    RULES,
    SFT_RULES,
    check_sft_rules,
    transport_reaches_the_engines,
    true_on_policy_on_the_cpu,
)

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = ["--lora.enabled", "true", "--lora.adapters", "[{name: add}, {name: rev}]"]
TP2 = ["--trainer.tensor-parallel-size", "2", "--cluster.trainer-ranks", "2"]
EP2 = ["--trainer.expert-parallel-size", "2", "--cluster.trainer-ranks", "2"]
CP2 = ["--trainer.context-parallel-size", "2", "--cluster.trainer-ranks", "2"]
VLLM = ["--cluster.engine", "vllm", "--sync.transport", "disk"]
DIFFUSION = ["--model.kind", "diffusion", "--cluster.engine", "diffusion", "--cluster.device", "cpu",
             "--reward.type", "jpeg_compressibility"]

# rule -> (overrides that break it, what the message says)
CASES: dict[str, tuple[list[str], str]] = {
    "rollout_divides_into_train_steps": (["--rollout.batch-size", "3", "--trainer.global-batch-size", "16"],
                                         r"3 × 8 = 24 samples per rollout is not divisible by trainer.global_batch_size = 16"),
    "train_steps_take_whole_groups": (["--rollout.batch-size", "3", "--rollout.n-samples-per-prompt", "4",
                                       "--trainer.global-batch-size", "6"],
                                      r"trainer.global_batch_size = 6 is not a multiple of rollout.n_samples_per_prompt = 4"),
    "train_steps_split_across_ranks": (["--rollout.batch-size", "3", "--rollout.n-samples-per-prompt", "2",
                                        "--cluster.trainer-ranks", "4"],
                                       r"trainer.global_batch_size = 6 is not divisible by cluster.trainer_ranks = 4"),
    "tensor_parallel_divides_the_ranks": (["--trainer.tensor-parallel-size", "3", "--cluster.trainer-ranks", "2"],
                                          r"trainer.tensor_parallel_size = 3 does not divide cluster.trainer_ranks = 2"),
    "tensor_parallel_has_a_plan": ([*TP2, "--lora.enabled", "true"],
                                   r"trainer.tensor_parallel_size = 2 cannot combine with lora.enabled = true"),
    "expert_parallel_divides_the_ranks": (["--trainer.expert-parallel-size", "4", "--cluster.trainer-ranks", "2"],
                                          r"trainer.expert_parallel_size = 4 does not divide cluster.trainer_ranks = 2"),
    "expert_parallel_has_a_plan": ([*EP2, "--lora.enabled", "true"],
                                   r"trainer.expert_parallel_size = 2 cannot combine with lora.enabled = true"),
    "context_parallel_divides_the_ranks": (["--trainer.context-parallel-size", "4", "--cluster.trainer-ranks", "2"],
                                           r"trainer.context_parallel_size = 4 does not divide cluster.trainer_ranks = 2"),
    "context_parallel_has_a_plan": ([*CP2, "--lora.enabled", "true"],
                                    r"trainer.context_parallel_size = 2 cannot combine with lora.enabled = true"),
    "sequence_parallel_has_a_plan": (["--trainer.sequence-parallel", "true"],
                                     r"trainer.sequence_parallel = true needs trainer.tensor_parallel_size > 1"),
    "over_sampling_covers_the_batch": (["--rollout.over-sampling-batch-size", "4"],
                                       r"rollout.over_sampling_batch_size = 4 is smaller than rollout.batch_size = 32"),
    "in_flight_holds_a_group": (["--rollout.max-in-flight", "4"],
                                r"rollout.max_in_flight = 4 cannot hold one group of rollout.n_samples_per_prompt = 8"),
    "context_leaves_room_for_a_prompt": (["--rollout.max-context-tokens", "16"],
                                         r"rollout.max_context_tokens = 16 leaves no room"),
    "fully_async_needs_disaggregated": (["--schedule", "fully_async", "--cluster.placement", "colocated"],
                                        r"schedule = 'fully_async' with cluster.placement = 'colocated' is refused"),
    "fully_async_calls_no_rollout_fn": (["--schedule", "fully_async", "--rollout.rollout-fn", "m:f"],
                                        r"rollout.rollout_fn = 'm:f' with schedule = 'fully_async' is refused"),
    "staleness_admission_needs_a_limit": (["--rollout.admission", "staleness"],
                                          r"rollout.admission = 'staleness' .* buffer.max_staleness = None"),
    "staleness_admission_is_fully_async": (["--rollout.admission", "staleness", "--buffer.max-staleness", "2"],
                                           r"rollout.admission = 'staleness' paces the fully async worker, and "
                                           r"schedule = 'sync' runs none"),
    "group_requests_fit": (["--rollout.request-per", "group", *VLLM],
                           r"rollout.request_per = 'group' with cluster.engine = 'vllm' is refused: it takes one sample"),
    "partial_rollouts_abort_on_a_weight_update": (["--rollout.partial-rollout", "true"],
                                                  r"rollout.partial_rollout = true with sync.pause_mode = 'retract' "
                                                  r"is refused: .*set sync.pause_mode = 'abort'"),
    "restarts_need_checkpoints": (["--fault.max-restarts", "1"],
                                  r"fault.max_restarts = 1 .* checkpoint.interval = 0"),
    "mismatch_correction_needs_trainer_logprobs": (["--algorithm.mismatch-correction", "tis",
                                                    "--algorithm.old-logprobs", "rollout"],
                                                   r"mismatch_correction = 'tis' .*old_logprobs = 'rollout'"),
    "mismatch_fn_replaces_the_correction": (["--algorithm.mismatch-fn", "m:f", "--algorithm.mismatch-correction", "tis"],
                                            r"mismatch_fn = 'm:f' replaces algorithm.mismatch_correction = 'tis'"),
    "importance_weighted_kl_needs_a_kl_loss": (["--algorithm.kl-importance-weighted", "true"],
                                               r"kl_importance_weighted = true .*kl_loss_coef > 0"),
    "kl_penalty_needs_a_token_level_estimator": (["--algorithm.kl-penalty-coef", "0.1"],
                                                 r"kl_penalty_coef = 0.1 needs a token-level estimator \('reinforce_plus_"
                                                 r"plus', 'reinforce_plus_plus_baseline', 'ppo'\), got .* 'grpo'"),
    "something_to_train_on": (["--algorithm.reward-coef", "0"], r"reward_coef = 0 with algorithm.distill_coef = 0"),
    "mismatch_band_is_ordered": (["--algorithm.tis-clip-low", "3"],
                                 r"algorithm.tis_clip_low = 3.0 must be < algorithm.tis_clip = 2.0"),
    "critic_settings_need_a_critic": (["--critic.lr", "1e-4"],
                                      r"critic.lr changed from the default, but algorithm.advantage_estimator = 'grpo'"),
    "distillation_needs_a_teacher": (["--algorithm.distill-coef", "0.5"],
                                     r"distill_coef = 0.5 needs a teacher's logprobs: set teacher.model_path"),
    "a_teacher_needs_distillation": (["--teacher.model-path", "T"],
                                     r"teacher.model_path = 'T' with algorithm.distill_coef = 0"),
    "true_on_policy_needs_one_forward": (["--algorithm.true-on-policy", "true", "--model.dtype", "bfloat16"],
                                         r"true_on_policy = true needs model.dtype = float32 .* got model.dtype = "
                                         "'bfloat16'"),
    "routing_replay_needs_routed_experts": (["--algorithm.routing-replay", "replay", *VLLM],
                                            r"routing_replay = 'replay' needs engines that return routed experts.* "
                                            r"cluster.engine = 'vllm'.*use 'embedded'"),
    "engine_takes_the_transport": (["--cluster.engine", "vllm"],
                                   r"sync.transport = 'distributed' is not supported with cluster.engine = 'vllm': "
                                   r"vLLM takes new weights from disk.*use one of \['disk'\]"),
    "colocated_engines_release_memory": (["--cluster.engine", "sglang", "--cluster.placement", "colocated",
                                          "--sync.transport", "tensor"],
                                         r"cluster.placement = 'colocated' with cluster.engine = 'sglang' needs "
                                         r"sglang.enable-memory-saver = true"),
    "engine_loads_lora": (["--lora.enabled", "true", "--cluster.engine", "sglang", "--sync.transport", "disk"],
                          r"lora.enabled = true with cluster.engine = 'sglang' needs sglang.enable-lora = true"),
    "adapter_tensors_need_an_engine_that_loads_them": (["--lora.enabled", "true", "--cluster.engine", "sglang",
                                                        "--sglang.enable-lora"],
                                                       r"lora.sync = 'adapter' with sync.transport = 'distributed': "
                                                       r"cluster.engine = 'sglang' does not load an adapter from "
                                                       r"pushed tensors \(only 'embedded' does\)"),
    "model_impl_is_the_embedded_engines": (["--model.impl", "native", *VLLM],
                                           r"model.impl = 'native' chooses the embedded engine's model class"),
    "engine_flags_go_to_their_engine": (["--sglang.tp-size", "2"],
                                        r"\[sglang\] flags \(tp-size\) are given, but cluster.engine = 'embedded'"),
    "colocated_broadcast_needs_a_gpu_each": (["--cluster.placement", "colocated", "--cluster.device", "cuda"],
                                             r"sync.transport = 'distributed' with cluster.placement = 'colocated' on "
                                             r"cluster.device = 'cuda' \(CUDA\): .*NCCL refuses two ranks of one group "
                                             r"on one GPU; use sync.transport = 'tensor' or 'disk'"),
    "cuda_ipc_needs_an_engine_that_takes_it": (["--plugins", "[tests.unit.engine_without_ipc]", "--cluster.engine",
                                                "no_ipc", "--sync.transport", "tensor", "--cluster.device", "cuda"],
                                               r"sync.transport = 'tensor' with cluster.engine = 'no_ipc' on "
                                               r"cluster.device = 'cuda' \(CUDA\)"),
    "sandboxes_go_to_an_agent_fn": (["--sandbox.provider", "local", "--rollout.agent-fn", "examples.coding.agent:run"],
                                    r"sandbox.provider = 'local' hands each episode's sandbox to the agent fn: set "
                                    r"rollout.generate_fn = 'verst.rollout.agentic:generate' \(it is None\)"),
    "eval_fleet_or_backend": (["--eval.num-engines", "1", "--eval.backend", "m:f"],
                              r"eval.num_engines = 1 with eval.backend = 'm:f'"),
    "reward_source_has_its_setting": (["--reward.type", "remote"], r"reward.type = 'remote' needs reward.url"),
    "group_rewards_need_a_group_fn": (["--reward.group", "true"],
                                      r"reward.group = true needs a custom group fn; reward.type = 'numeric_match'"),
    "adapters_train_with_lora": (["--lora.adapters", "[{name: add}]"],
                                 r"lora.adapters names \['add'\] but lora.enabled = false"),
    "adapters_on_a_multi_lora_schedule": ([*ADAPTERS, "--schedule", "one_step_off"],
                                          r"lora.adapters \(multi-LoRA\) with schedule = 'one_step_off'"),
    "adapters_train_one_policy_each": ([*ADAPTERS, "--checkpoint.merge-lora", "true"],
                                       r"checkpoint.merge_lora = true with lora.adapters"),
    "core_budget_is_for_the_cpu": (["--cluster.device", "cuda", "--cluster.cores", "4"],
                                   r"cluster.cores = 4 set the CPU's core budget, and cluster.device = 'cuda'"),
    "core_budget_is_one_machines": (["--cluster.ray-address", "10.0.0.1:6379", "--cluster.trainer-threads", "2"],
                                    r"cluster.trainer_threads = 2 plan the cores of the machine the run starts on"),
    "engine_takes_its_core_share": ([*VLLM, "--cluster.engine-threads", "2"],
                                    r"cluster.engine_threads = 2 with cluster.engine = 'vllm': that engine sets its own"),
    "true_on_policy_trains_on_one_thread": (["--algorithm.true-on-policy", "true", "--cluster.trainer-threads", "2"],
                                            r"cluster.trainer_threads = 2 with algorithm.true_on_policy = true"),
    "every_adapter_is_a_valid_run": ([*ADAPTERS, "--lora.adapters", "[{name: add, batch_size: 3, global_batch_size: 16}]"],
                                     r"lora.adapters\[0\] \('add'\): .*3 × 8 = 24 samples per rollout"),
    "image_engines_serve_diffusion_models": (["--model.kind", "diffusion"],
                                             r"model.kind = 'diffusion' needs an engine that samples images: "
                                             r"cluster.engine = 'diffusion', not 'embedded'"),
    "diffusion_runs_use_what_images_have": ([*DIFFUSION, "--lora.enabled", "true"],
                                            r"lora.enabled = true does not apply to model.kind = 'diffusion' \(LoRA"),
    "stale_images_take_the_engines_logprobs": ([*DIFFUSION, "--schedule", "fully_async"],
                                               r"schedule = 'fully_async' trains on images sampled by older weights; "
                                               r"with model.kind = 'diffusion' set algorithm.old_logprobs = 'rollout'"),
    "rewards_score_what_the_model_makes": ([*DIFFUSION, "--reward.type", "shape_alignment", "--reward.key", "alignment"],
                                           r"reward.type = 'shape_alignment' scores with a model of its own: set "
                                           r"reward.model_path"),
}


def test_every_rule_has_a_case():
    assert sorted(CASES) == sorted(rule.__name__ for rule in RULES)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_a_broken_rule_is_refused_by_field(rule, registries_restored):
    overrides, message = CASES[rule]
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_expert_parallel_trains_an_moe_alone():
    """The plan is for transformers' MoE, whole weights, one policy, no tensor parallelism: each other case
    refused by name."""
    assert load_config(None, EP2).trainer.expert_parallel_size == 2
    assert load_config(None, [*EP2, "--algorithm.routing-replay", "replay"]).trainer.expert_parallel_size == 2
    refused = {"trainer.tensor_parallel_size = 2": ["--trainer.tensor-parallel-size", "2"],
               "model.impl = 'native'": ["--model.impl", "native"],
               "algorithm.true_on_policy = true": ["--algorithm.true-on-policy", "true"],
               "algorithm.advantage_estimator = 'ppo'": ["--algorithm.advantage-estimator", "ppo"]}
    for setting, overrides in refused.items():
        with pytest.raises(ConfigError, match=f"trainer.expert_parallel_size = 2 cannot combine with {setting}"):
            load_config(None, [*EP2, *overrides])


def test_tensor_parallel_trains_a_dense_model_alone():
    """The plan is for dense models, whole weights and one policy: each other case refused by name."""
    assert load_config(None, TP2).trainer.tensor_parallel_size == 2
    assert load_config(None, [*TP2, "--model.impl", "transformers"]).trainer.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match="cannot combine with algorithm.routing_replay = 'replay'"):
        load_config(None, [*TP2, "--algorithm.routing-replay", "replay"])
    with pytest.raises(ConfigError, match="cannot combine with algorithm.true_on_policy = true"):
        load_config(None, [*TP2, "--algorithm.true-on-policy", "true"])
    with pytest.raises(ConfigError, match="cannot combine with algorithm.advantage_estimator = 'ppo'"):
        load_config(None, [*TP2, "--algorithm.advantage-estimator", "ppo"])


def test_sequence_parallel_splits_the_positions_under_tensor_parallelism():
    """With tensor parallel > 1, on either model; alone refused by name. What tensor parallelism refuses stays refused
    with it."""
    sp = [*TP2, "--trainer.sequence-parallel", "true"]
    assert load_config(None, sp).trainer.sequence_parallel
    assert load_config(None, [*sp, "--model.impl", "transformers"]).trainer.sequence_parallel
    with pytest.raises(ConfigError, match="trainer.sequence_parallel = true needs trainer.tensor_parallel_size > 1"):
        load_config(None, ["--trainer.sequence-parallel", "true", "--cluster.trainer-ranks", "2"])
    with pytest.raises(ConfigError, match="trainer.tensor_parallel_size = 2 cannot combine with lora.enabled = true"):
        load_config(None, [*sp, "--lora.enabled", "true"])
    with pytest.raises(ConfigError, match="trainer.sequence_parallel = true needs trainer.tensor_parallel_size > 1"):
        load_config(None, [*CP2, "--trainer.sequence-parallel", "true"])


def test_context_parallel_trains_the_native_model_alone():
    """Rows split in the native attention, whole weights, one policy, no other model-parallel axis: each other case
    refused by name."""
    assert load_config(None, CP2).trainer.context_parallel_size == 2
    assert load_config(None, [*CP2, "--model.impl", "native"]).trainer.context_parallel_size == 2
    dp2_cp2 = load_config(None, ["--trainer.context-parallel-size", "2", "--cluster.trainer-ranks", "4",
                                 "--trainer.global-batch-size", "8", "--rollout.batch-size", "1"])
    assert (dp2_cp2.trainer.context_parallel_size, dp2_cp2.cluster.trainer_ranks) == (2, 4)
    four = ["--cluster.trainer-ranks", "4", "--trainer.global-batch-size", "8", "--rollout.batch-size", "1"]
    refused = {"trainer.tensor_parallel_size = 2": [*four, "--trainer.tensor-parallel-size", "2"],
               "trainer.expert_parallel_size = 2": ["--trainer.expert-parallel-size", "2", "--model.impl", "auto"],
               "model.impl = 'transformers'": ["--model.impl", "transformers"],
               "algorithm.routing_replay = 'measure'": ["--algorithm.routing-replay", "measure"],
               "lora.enabled = true": ["--lora.enabled", "true"],
               "algorithm.true_on_policy = true": ["--algorithm.true-on-policy", "true"],
               "algorithm.advantage_estimator = 'ppo'": ["--algorithm.advantage-estimator", "ppo"]}
    for setting, overrides in refused.items():
        with pytest.raises(ConfigError, match=f"trainer.context_parallel_size = 2 cannot combine with {setting}"):
            load_config(None, [*CP2, *overrides])


def test_partial_rollouts_need_abort_pauses_an_engine_with_partial_output_and_a_generate_fn_that_continues():
    partial = ["--rollout.partial-rollout", "true", "--sync.pause-mode", "abort"]
    cfg = load_config(None, [*partial, "--algorithm.max-token-staleness", "1"])
    assert cfg.rollout.partial_rollout and cfg.algorithm.max_token_staleness == 1
    assert load_config(None, [*partial, "--rollout.generate-fn", "verst.rollout.generate:generate"]).rollout.partial_rollout
    agentic = ["--rollout.generate-fn", "verst.rollout.agentic:generate", "--rollout.agent-fn", "m:agent"]
    assert load_config(None, [*partial, *agentic]).rollout.partial_rollout  # the session server continues a turn
    # the direct multi-turn generate fn continues a turn itself
    assert load_config(None, [*partial, "--rollout.generate-fn", "verst.rollout.multiturn:generate"]).rollout.partial_rollout
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout = true with cluster.engine = 'vllm' is refused"):
        load_config(None, [*partial, *VLLM])
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout = true with rollout.generate_fn = 'm:f' is refused"):
        load_config(None, [*partial, "--rollout.generate-fn", "m:f"])
    with pytest.raises(ConfigError, match=r"max_token_staleness"):
        load_config(None, ["--algorithm.max-token-staleness", "-1"])


def test_rules_of_what_the_run_finds_at_start_up():
    algorithm = load_config(None, ["--algorithm.true-on-policy", "true"]).algorithm
    true_on_policy_on_the_cpu(algorithm, "cpu")
    with pytest.raises(ValueError, match="true_on_policy = true holds on the CPU only.*cluster.device = 'cpu'"):
        true_on_policy_on_the_cpu(algorithm, "cuda")
    transport_reaches_the_engines("tensor", "10.0.0.1", ["10.0.0.1"])
    transport_reaches_the_engines("distributed", "10.0.0.1", ["10.0.0.2"])  # a broadcast crosses machines
    with pytest.raises(ValueError, match=r"engine\(s\) \[0\] were placed on \['10.0.0.2'\]"):
        transport_reaches_the_engines("tensor", "10.0.0.1", ["10.0.0.2", "10.0.0.1"])


def test_core_count_against_the_machine():
    cores_exist(None, (0, 1))
    cores_exist(2, (0, 1))
    with pytest.raises(ValueError, match=r"cluster.cores = 3, but this process may run on 2 core\(s\) \(\[0, 1\]\)"):
        cores_exist(3, (0, 1))


def test_rules_of_sft():
    assert [rule.__name__ for rule in SFT_RULES] == ["sft_trains_one_policy", "sft_trains_a_language_model"]
    check_sft_rules(load_config(None, []))
    with pytest.raises(ValueError, match=r"lora.adapters \(\['add', 'rev'\]\): multi-LoRA trains with RL only"):
        check_sft_rules(load_config(None, ADAPTERS))
    with pytest.raises(ValueError, match="eval.num_engines = 2: the evaluation fleet scores RL runs"):
        check_sft_rules(load_config(None, ["--eval.num-engines", "2"]))
    with pytest.raises(ValueError, match="model.kind = 'diffusion': SFT trains language models on text"):
        check_sft_rules(load_config(None, DIFFUSION))


def test_config_loading_imports_no_torch():
    """Every recipe, and the defaults with every cluster.device and sync.transport, load (or are refused by
    a rule) in a Python where `import torch` raises; `--dry-run` is as torch-free."""
    recipes = sorted(str(p) for p in (REPO / "recipes").glob("*.toml"))
    cases = [[recipe] for recipe in recipes]
    cases += [[None, "--cluster.device", device, "--sync.transport", transport]
              for device in ("auto", "cpu", "cuda") for transport in WEIGHT_TRANSPORTS]
    cases += [[None, "--cluster.engine", engine, "--sync.transport", "disk"] for engine in ENGINE_KINDS]
    code = f"""
import builtins, sys
real_import = builtins.__import__
def no_torch(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ModuleNotFoundError("import torch is refused here")
    return real_import(name, *args, **kwargs)
builtins.__import__ = no_torch
from verst.config import ConfigError, load_config
loaded = refused = 0
for recipe, *overrides in {cases!r}:
    try:
        load_config(recipe, overrides)
        loaded += 1
    except ConfigError:
        refused += 1
from verst.cli.main import main
main(["train", {recipes[0]!r}, "--dry-run"])  # refused by the preflight here (no artifacts), or printed
assert "torch" not in sys.modules
print(loaded, refused)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, refused = map(int, done.stdout.split()[-2:])
    assert loaded >= len(recipes) and loaded + refused == len(cases)


def test_one_request_per_group_needs_the_default_fns_whole_groups_and_an_engine_that_takes_and_seeds_n():
    group = ["--rollout.request-per", "group"]
    assert load_config(None, group).rollout.request_per == "group"
    seeded = ["--rollout.sampling.seed", "3"]
    assert load_config(None, [*group, *seeded, "--rollout.generate-fn", "verst.rollout.generate:generate"])
    fully_async = ["--schedule", "fully_async"]
    assert load_config(None, [*group, *fully_async, "--rollout.submission-granularity", "group"])
    for overrides, message in [
        (["--rollout.generate-fn", "m:f"], r"rollout.generate_fn = 'm:f' is refused: .* owns one sample's generation"),
        (["--rollout.rollout-fn", "m:f"], r"rollout.rollout_fn = 'm:f' is refused"),
        (fully_async, r"rollout.submission_granularity = 'sample' is refused: .* set rollout.submission_granularity "
                      "= 'group'"),
        (["--cluster.engine", "sglang", *seeded], r"rollout.sampling.seed = 3 and cluster.engine = 'sglang' is "
                                                  r"refused: .* use cluster.engine = 'embedded'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*group, *overrides])
    assert load_config(None, [*group, "--cluster.engine", "sglang"]).cluster.engine == "sglang"  # unseeded: fine
