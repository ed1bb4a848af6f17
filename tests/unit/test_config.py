import subprocess
import sys

import pytest

from verst.config import ConfigError, VerstConfig, batch_plan, iter_fields, load_config, load_object, parse_overrides
from verst.config.imports import ImportPathError


def test_defaults_validate_and_plan():
    cfg = load_config()
    plan = batch_plan(cfg)
    assert plan.samples_per_rollout == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    assert plan.global_batch_size == plan.samples_per_rollout
    assert plan.train_steps_per_rollout == 1


def test_every_field_has_a_doc_line():
    fields = list(iter_fields())
    assert len(fields) > 60
    missing = [name for name, _, _, doc in fields if not doc.strip()]
    assert missing == []


def test_recipe_files_and_overrides_precedence(tmp_path):
    toml = tmp_path / "r.toml"
    toml.write_text('name = "t"\n[rollout]\nbatch_size = 4\nn_samples_per_prompt = 2\n[trainer]\nlr = 0.001\n')
    yml = tmp_path / "r.yaml"
    yml.write_text("name: y\nrollout:\n  batch-size: 8\n  n_samples_per_prompt: 4\n")
    cfg = load_config(toml, ["--rollout.batch-size", "6", "--trainer.lr=2e-4", "--logging.progress", "false"])
    assert (cfg.name, cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt) == ("t", 6, 2)
    assert cfg.trainer.lr == pytest.approx(2e-4)
    assert cfg.logging.progress is False
    cfg = load_config(yml, ["--rollout.sampling.stop", "[a, b]", "--logging.tensorboard"])
    assert (cfg.name, cfg.rollout.batch_size, cfg.rollout.sampling.stop) == ("y", 8, ["a", "b"])
    assert cfg.logging.tensorboard is True


def test_parse_overrides():
    assert parse_overrides(["--a.b-c", "16", "--x=[1, 2]", "--flag"]) == [("a.b_c", 16), ("x", [1, 2]), ("flag", True)]
    with pytest.raises(ConfigError, match="expected an override like --section.field VALUE, got 'oops'"):
        parse_overrides(["oops"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        # unknown keys, top level and nested, with a suggestion
        (["--rollout.batchsize", "3"], "unknown config field 'rollout.batchsize' (value 3); did you mean 'rollout.batch_size'?"),
        (["--colour", "red"], "unknown config field 'colour' (value 'red')"),
        (["--rollout.sampling.temp", "1"], "unknown config field 'rollout.sampling.temp'"),
        (["--rollout", "3"], "rollout: is a section, expected a table of fields, got 3"),
        # wrong types
        (["--algorithm.eps-clip", "abc"], "algorithm.eps_clip: Input should be a valid number"),
        (["--rollout.batch-size", "2.5"], "rollout.batch_size: Input should be a valid integer"),
        (["--schedule", "async"], "schedule: Input should be 'sync', 'one_step_off' or 'fully_async' (got 'async')"),
        # out of range
        (["--rollout.batch-size", "0"], "rollout.batch_size: Input should be greater than or equal to 1 (got 0)"),
        (["--rollout.sampling.top-p", "1.5"], "rollout.sampling.top_p: Input should be less than or equal to 1 (got 1.5)"),
        (["--rollout.sampling.top-k", "0"], "top_k = 0 keeps no token"),
        (["--trainer.lr", "-1"], "trainer.lr: Input should be greater than 0 (got -1)"),
    ],
)
def test_bad_config_names_field_and_value(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_tensor_transport_to_the_embedded_engine_on_cpu_is_accepted():
    cfg = load_config(None, ["--sync.transport", "tensor", "--cluster.device", "cpu"])
    assert (cfg.sync.transport, cfg.cluster.engine) == ("tensor", "embedded")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--rollout.batch-size", "3", "--trainer.global-batch-size", "16"],
            "3 × 8 = 24 samples per rollout is not divisible by trainer.global_batch_size = 16",
        ),
        (
            ["--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "3", "--trainer.global-batch-size", "4"],
            "trainer.global_batch_size = 4 is not a multiple of rollout.n_samples_per_prompt = 3",
        ),
        (["--rollout.batch-size", "3", "--cluster.trainer-ranks", "5"], "global_batch_size = 24 is not divisible by cluster.trainer_ranks = 5"),
        (["--rollout.over-sampling-batch-size", "4"], "over_sampling_batch_size = 4 is smaller than rollout.batch_size = 32"),
        (["--rollout.max-in-flight", "4"], "rollout.max_in_flight = 4 cannot hold one group"),
        (["--rollout.max-context-tokens", "16"], "max_context_tokens = 16 leaves no room"),
        (["--schedule", "fully_async", "--cluster.placement", "colocated"], "'fully_async' with cluster.placement = 'colocated' is refused"),
        (["--schedule", "fully_async", "--rollout.rollout-fn", "examples.plugins.rollout:one_round"],
         "rollout.rollout_fn = 'examples.plugins.rollout:one_round' with schedule = 'fully_async' is refused"),
        (["--fault.max-restarts", "1"], "fault.max_restarts = 1 restarts a run from its latest checkpoint, but "
                                        "checkpoint.interval = 0 saves none before the end"),
        (["--cluster.placement", "colocated", "--cluster.device", "cuda"],
         "sync.transport = 'distributed' with cluster.placement = 'colocated' on cluster.device = 'cuda' (CUDA): the "
         "trainer and an engine share a GPU, and NCCL refuses two ranks of one group on one GPU; use sync.transport = "
         "'tensor' or 'disk'"),
        (["--reward.type", "custom"], "reward.type = 'custom' needs reward.path"),
        (["--reward.type", "remote"], "reward.type = 'remote' needs reward.url"),
        (["--algorithm.mismatch-correction", "tis", "--algorithm.old-logprobs", "rollout"], "cannot be combined with algorithm.old_logprobs = 'rollout'"),
        (["--algorithm.kl-penalty-coef", "0.1"], "algorithm.kl_penalty_coef = 0.1 needs a token-level estimator"),
        (["--algorithm.tis-clip-low", "3"], "algorithm.tis_clip_low = 3.0 must be < algorithm.tis_clip = 2.0"),
    ],
)
def test_inconsistent_config_fails_with_numbers(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_recipe_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(bad)
    ext = tmp_path / "r.json"
    ext.write_text("{}")
    with pytest.raises(ConfigError, match="extension '.json' is not .toml, .yaml or .yml"):
        load_config(ext)


def test_config_model_rejects_unknown_and_assignment():
    with pytest.raises(Exception, match="Extra inputs are not permitted"):
        VerstConfig.model_validate({"rollout": {"nope": 1}})
    cfg = VerstConfig()
    with pytest.raises(Exception, match="greater than or equal to 1"):
        cfg.rollout.batch_size = 0


def test_load_object():
    import os.path

    assert load_object("os.path:join") is os.path.join
    assert load_object("os.path.join") is os.path.join
    with pytest.raises(ImportPathError, match="reward.path = 'nope_mod:x': cannot import module 'nope_mod'"):
        load_object("nope_mod:x", "reward.path")
    with pytest.raises(ImportPathError, match="has no attribute 'nope'"):
        load_object("os.path:nope", "reward.path")
    with pytest.raises(ImportPathError, match="is not of the form"):
        load_object("justaname", "reward.path")


def test_schedules_import_no_torch_until_a_run_starts():
    # The driver of an RL run imports no torch at all (tests/e2e: test_the_driver_of_a_run_imports_no_torch);
    # a module-level torch import here would put 3-5 s in front of Ray's start on 2 cores.
    code = ("import sys, verst.schedules.fully_async, verst.schedules.sync, verst.schedules.one_step_off; "
            "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('verst')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_import_does_not_import_torch():
    code = "import sys, verst.config, verst.types, verst.cli.main; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("override, message", [
    (["--algorithm.distill-coef", "0.5"], "algorithm.distill_coef = 0.5 needs a teacher's logprobs: set "
                                           "teacher.model_path"),
    (["--teacher.model-path", "t"], "teacher.model_path = 't' with algorithm.distill_coef = 0"),
    (["--algorithm.reward-coef", "0"], "algorithm.reward_coef = 0 with algorithm.distill_coef = 0"),
    (["--critic.lr", "1e-4", "--critic.model-path", "m"],
     r"critic.model_path, critic.lr changed from the default, but algorithm.advantage_estimator = 'grpo' trains no value model"),
])
def test_modes_a_run_cannot_carry_out_are_refused_at_start_up(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


def test_pure_on_policy_distillation_is_accepted():
    cfg = load_config(None, ["--teacher.model-path", "t", "--algorithm.distill-coef", "1", "--algorithm.reward-coef", "0"])
    assert (cfg.teacher.model_path, cfg.teacher.num_engines, cfg.algorithm.reward_coef) == ("t", 1, 0.0)
@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "fully_async"])
def test_ppo_with_its_critic_is_accepted_on_every_schedule(schedule):
    cfg = load_config(None, ["--algorithm.advantage-estimator", "ppo", "--critic.lr", "1e-4", "--schedule", schedule,
                             "--lora.enabled", "true"])
    assert cfg.algorithm.needs_critic and cfg.critic.lr == 1e-4 and cfg.critic.model_path is None


def test_the_colocated_broadcast_rule_reads_no_torch_when_the_device_is_named():
    # config loading stays torch-free (`verst train --dry-run`); only cluster.device = 'auto' asks torch
    code = ("import sys; from verst.config.load import load_config; "
            "load_config(None, ['--cluster.placement', 'colocated', '--cluster.device', 'cpu']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
