"""The mistakes `verst train` and `verst sft` catch before anything starts, each with its exact message:
a flag without its value, true/false for a number, a run directory that holds another run, and files,
tokenizers and plug-in modules that are not there."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from verst.cli.preflight import PreflightError, preflight
from verst.config import ConfigError, load_config
from verst.monitor import RunDirError, prepare_run_dir


def cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    code = "import sys; from verst.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("argv, message", [
    (["--rollout.batch-size"], "--rollout.batch-size needs a value (int)"),
    (["--rollout.batch-size", "--trainer.lr", "1e-4"],
     "--rollout.batch-size needs a value (int); it is followed by '--trainer.lr'"),
    (["--rollout.batch-size", "true"], "rollout.batch_size: expected int, got True"),
    (["--trainer.lr=false"], "trainer.lr: expected float, got False"),
    (["--rollout.max-in-flight", "true"], "rollout.max_in_flight: expected int | None, got True"),
])
def test_a_number_never_becomes_a_boolean(argv, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, argv)
    assert message in str(error.value)


def test_booleans_still_stand_alone_and_recipes_are_checked_too(tmp_path):
    assert load_config(None, ["--logging.progress"]).logging.progress is True
    assert load_config(None, ["--overwrite"]).overwrite is True
    recipe = tmp_path / "r.toml"
    recipe.write_text("[rollout]\nbatch_size = true\n")
    with pytest.raises(ConfigError, match="rollout.batch_size: expected int, got True"):
        load_config(recipe)


def test_dry_run_refuses_a_flag_without_value_naming_it():
    result = cli("train", "--rollout.batch-size", "--dry-run")
    assert result.returncode == 2
    assert "verst train: --rollout.batch-size needs a value (int)" in result.stderr


def good_config(tmp_path, tiny_model_dir, addition_data_dir, *extra):
    return load_config(None, [
        "--model.path", str(tiny_model_dir), "--data.train-path", str(addition_data_dir / "train.jsonl"),
        "--data.test-path", str(addition_data_dir / "test.jsonl"), "--run-dir", str(tmp_path / "run"), *extra])


def test_a_good_config_passes_preflight_in_under_a_second(tmp_path, tiny_model_dir, addition_data_dir):
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir)
    start = time.perf_counter()
    preflight(cfg, rl=True)
    assert time.perf_counter() - start < 1.0  # a bound with wide margin: the check reads a few small files
    assert not (tmp_path / "run").exists()  # checked, not created


def test_preflight_names_every_missing_thing(tmp_path, tiny_model_dir, addition_data_dir):
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir,
                      "--model.path", str(tmp_path / "no-model"), "--data.train-path", str(tmp_path / "no.jsonl"),
                      "--eval.path", str(tmp_path), "--rollout.agent-fn", "no_such_pkg_xyz.agent:run",
                      "--reward.type", "custom", "--reward.path", "verst.no_such_module:fn",
                      "--checkpoint.load", str(tmp_path / "ckpt"))
    with pytest.raises(PreflightError) as error:
        preflight(cfg, rl=True)
    lines = str(error.value).splitlines()[1:]
    assert [line.strip() for line in lines] == [
        f"model.path = {str(tmp_path / 'no-model')!r} does not exist; expected a Hugging Face checkpoint directory",
        f"data.train_path = {str(tmp_path / 'no.jsonl')!r} does not exist",
        f"eval.path = {str(tmp_path)!r} is a directory, not a file",
        f"checkpoint.load = {str(tmp_path / 'ckpt')!r}: {str(tmp_path / 'ckpt')!r} does not exist",
        "rollout.agent_fn = 'no_such_pkg_xyz.agent:run': cannot import a parent of module 'no_such_pkg_xyz.agent' "
        "(No module named 'no_such_pkg_xyz')",
        "reward.path = 'verst.no_such_module:fn': no module named 'verst.no_such_module' "
        "(on sys.path or in the working directory)",
    ]


def test_preflight_names_a_critic_checkpoint_that_is_not_there(tmp_path, tiny_model_dir, addition_data_dir):
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir, "--algorithm.advantage-estimator", "ppo",
                      "--critic.model-path", str(tmp_path / "no-critic"))
    with pytest.raises(PreflightError) as error:
        preflight(cfg, rl=True)
    assert [line.strip() for line in str(error.value).splitlines()[1:]] == [
        f"critic.model_path = {str(tmp_path / 'no-critic')!r} does not exist; expected a Hugging Face checkpoint "
        "directory"]
    preflight(good_config(tmp_path, tiny_model_dir, addition_data_dir, "--algorithm.advantage-estimator", "ppo",
                          "--critic.model-path", str(tiny_model_dir)), rl=True)


def test_preflight_names_each_loss_plug_in_that_is_not_there(tmp_path, tiny_model_dir, addition_data_dir):
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir,
                      "--algorithm.mismatch-fn", "verst.no_such_module:weights",
                      "--algorithm.policy-loss-fn", "no_such_pkg_xyz.losses:pg",
                      "--algorithm.loss-reducer", "examples.plugins.losses:token_sum_over_budget")
    with pytest.raises(PreflightError) as error:
        preflight(cfg, rl=True)
    assert [line.strip() for line in str(error.value).splitlines()[1:]] == [
        "algorithm.mismatch_fn = 'verst.no_such_module:weights': no module named 'verst.no_such_module' "
        "(on sys.path or in the working directory)",
        "algorithm.policy_loss_fn = 'no_such_pkg_xyz.losses:pg': cannot import a parent of module "
        "'no_such_pkg_xyz.losses' (No module named 'no_such_pkg_xyz')",
    ]  # the reducer's module exists: it passes


def test_preflight_checks_the_tokenizer(tmp_path, tiny_model_dir, addition_data_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text("{not json")
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir, "--model.path", str(model))
    with pytest.raises(PreflightError, match=r"model.path = '.*/model': tokenizer.json does not load"):
        preflight(cfg, rl=False)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer_config.json").unlink()
    with pytest.raises(PreflightError, match=r"model.path = '.*/model' has no tokenizer.json or tokenizer_config"):
        preflight(cfg, rl=False)
    (model / "config.json").write_text(json.dumps({"a": 1})[:-1])
    with pytest.raises(PreflightError, match=r"model.path = '.*/model': config.json does not parse"):
        preflight(cfg, rl=False)


def test_preflight_refuses_a_teacher_with_another_tokenizer(tmp_path, tiny_model_dir, addition_data_dir):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir, teacher)
    distill = ("--teacher.model-path", str(teacher), "--algorithm.distill-coef", "1")
    preflight(good_config(tmp_path, tiny_model_dir, addition_data_dir, *distill), rl=True)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    tokenizer["added_tokens"][0]["content"] = "<|renamed|>"
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PreflightError, match=r"teacher.model_path = '.*/teacher' and model.path = .* have different "
                                             r"tokenizers"):
        preflight(good_config(tmp_path, tiny_model_dir, addition_data_dir, *distill), rl=True)


def test_a_run_directory_is_never_mixed(tmp_path, tiny_model_dir, addition_data_dir):
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir)
    run_dir = prepare_run_dir(cfg)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    message = (f"run directory {str(run_dir)!r} already holds a run (from name = 'run' or run_dir); pick another "
               "--name or --run-dir, or pass --overwrite to empty it first")
    with pytest.raises(RunDirError) as error:
        prepare_run_dir(cfg)
    assert str(error.value) == message
    with pytest.raises(PreflightError) as error:
        preflight(cfg, rl=True)
    assert message in str(error.value)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'  # refused: nothing lost
    prepare_run_dir(cfg.model_copy(update={"overwrite": True}))
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


def test_verst_train_stops_before_ray_naming_the_model_path(tmp_path):
    start = time.perf_counter()
    result = cli("train", "--model.path", str(tmp_path / "missing"), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert f"model.path = {str(tmp_path / 'missing')!r} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert "ray" not in result.stdout.lower()
    assert time.perf_counter() - start < 30  # a ceiling far above the check itself: Ray never started


def test_wandb_without_the_package_is_refused(tmp_path, tiny_model_dir, addition_data_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir, "--logging.wandb", "true")
    with pytest.raises(PreflightError, match="logging.wandb = true, but the wandb package is not installed"):
        preflight(cfg, rl=False)


def test_resume_takes_the_runs_config_and_passes_preflight(tmp_path, tiny_model_dir, addition_data_dir):
    from verst.cli.config_command import parse_config_command
    from verst.monitor import checkpoint_dirs as layout

    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir, "--trainer.lr", "3e-4")
    run = prepare_run_dir(cfg)
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(PreflightError, match="no complete checkpoint"):
        preflight(parse_config_command("train", ["--resume", str(run)], "")[0], rl=True)
    tmp = layout.new_tmp_dir(run, 2)
    (tmp / layout.TRAINER_DIR).mkdir()
    (tmp / layout.TRAINER_DIR / "COMPLETE").write_text("step 2\n")
    layout.commit(tmp, {"step": 2, "version": 2, "config": cfg.model_dump(mode="json")})

    resumed, _ = parse_config_command("train", ["--resume", str(run), "--rollout.num-rollouts", "9"], "")
    assert resumed.checkpoint.load == str(run) and resumed.trainer.lr == 3e-4 and resumed.rollout.num_rollouts == 9
    preflight(resumed, rl=True)  # its own, non-empty run directory is not refused
    changed, _ = parse_config_command("train", ["--resume", str(run), "--trainer.lr", "1e-3"], "")
    with pytest.raises(PreflightError, match=r"trainer.lr: checkpoint 0.0003, now 0.001"):
        preflight(changed, rl=True)
    with pytest.raises(SystemExit):
        parse_config_command("train", ["--resume"], "")


def test_preflight_refuses_the_model_modes_the_checkpoint_cannot_carry(tmp_path, tiny_model_dir, addition_data_dir):
    from verst.models.factory import init_model

    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir, "--algorithm.routing-replay", "measure")
    with pytest.raises(PreflightError) as error:
        preflight(cfg, rl=True)
    assert [line.strip() for line in str(error.value).splitlines()[1:]] == [
        f"algorithm.routing_replay = 'measure' needs an MoE model; model.path = {str(tiny_model_dir)!r} "
        "(model_type 'qwen3') has no expert router"]
    moe = init_model("qwen3-moe", "tiny", tmp_path / "moe")
    preflight(good_config(tmp_path, moe, addition_data_dir, "--algorithm.routing-replay", "replay"), rl=True)
    cfg = good_config(tmp_path, moe, addition_data_dir, "--algorithm.true-on-policy", "true")
    with pytest.raises(PreflightError, match="algorithm.true_on_policy = true needs a model the native class covers; "
                       f"model.path = {str(moe)!r}: model_type 'qwen3_moe' is not one of"):
        preflight(cfg, rl=True)


def test_preflight_refuses_expert_parallelism_the_checkpoint_cannot_split(tmp_path, tiny_model_dir, addition_data_dir):
    """A dense checkpoint has no experts; an MoE's expert count must be a multiple of the size (SFT and RL alike)."""
    import json

    from verst.models.factory import N_EXPERTS, init_model

    ep2 = ("--trainer.expert-parallel-size", "2", "--cluster.trainer-ranks", "2")
    for rl in (True, False):
        with pytest.raises(PreflightError, match=r"trainer.expert_parallel_size = 2 needs an MoE model; model.path = "
                           f"{str(tiny_model_dir)!r} \\(model_type 'qwen3'\\) has no experts"):
            preflight(good_config(tmp_path, tiny_model_dir, addition_data_dir, *ep2), rl=rl)
    moe = init_model("qwen3-moe", "tiny", tmp_path / "moe")
    preflight(good_config(tmp_path, moe, addition_data_dir, *ep2), rl=True)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "num_local_experts": N_EXPERTS + 1}))
    with pytest.raises(PreflightError, match=f"trainer.expert_parallel_size = 2 does not divide the num_experts = "
                       f"{N_EXPERTS + 1} of model.path"):
        preflight(good_config(tmp_path, moe, addition_data_dir, *ep2), rl=True)



def test_preflight_refuses_context_parallelism_on_a_model_the_native_class_does_not_cover(tmp_path, tiny_model_dir,
                                                                                         addition_data_dir):
    from verst.models.factory import init_model

    cp2 = ("--trainer.context-parallel-size", "2", "--cluster.trainer-ranks", "2")
    preflight(good_config(tmp_path, tiny_model_dir, addition_data_dir, *cp2), rl=True)
    moe = init_model("qwen3-moe", "tiny", tmp_path / "moe")
    with pytest.raises(PreflightError, match="trainer.context_parallel_size = 2 needs a model the native class covers; "
                       f"model.path = {str(moe)!r}: model_type 'qwen3_moe' is not one of"):
        preflight(good_config(tmp_path, moe, addition_data_dir, *cp2), rl=False)
