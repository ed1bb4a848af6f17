import subprocess
import sys

import pytest

from verst.cli.main import COMMANDS, main
from verst.config import iter_fields

NO_TORCH = "import sys; from verst.cli.main import main; rc = main({argv!r}); assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"


def run_cli(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH.format(argv=argv)], capture_output=True, text=True)


def test_top_level_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("model", "data", "sft", "train", "serve", "report"):
        assert name in COMMANDS and f"  {name}" in out


def test_unknown_command(capsys):
    assert main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


def listed_flags(help_text: str) -> set[str]:
    return {line.split()[0] for line in help_text.splitlines() if line.startswith("  --") and "." in line.split()[0]}


def test_train_help_lists_every_field_without_torch():
    result = run_cli(["train", "--help"])
    assert result.returncode == 0, result.stderr
    for dotted, _, default, doc in iter_fields():
        flag = f"--{dotted.replace('_', '-')} "
        assert flag in result.stdout, flag
        assert doc in result.stdout
        assert f"(default: {default!r})" in result.stdout


def test_sft_help_lists_only_the_fields_sft_reads_without_torch():
    from verst.cli.sft import SFT_FIELDS

    result = run_cli(["sft", "--help"])
    assert result.returncode == 0, result.stderr
    dotted = {name for name, *_ in iter_fields()}
    for name in SFT_FIELDS:  # each names a field or a section of the schema
        assert name in dotted or any(field.startswith(f"{name}.") for field in dotted), name
    flags = listed_flags(result.stdout)
    assert {"--sft.num-steps", "--trainer.lr", "--checkpoint.keep-last", "--lora.rank", "--data.train-path",
            "--eval.max-prompts", "--rollout.agent-fn"} <= flags
    rl_only = {flag for flag in flags if flag.startswith(("--algorithm.", "--buffer.", "--sync.", "--teacher.",
                                                          "--critic.", "--fault.", "--vllm", "--sglang"))}
    assert rl_only == set()
    assert not flags & {"--rollout.batch-size", "--rollout.n-samples-per-prompt", "--trainer.global-batch-size",
                        "--cluster.num-engines", "--lora.adapters", "--eval.backend"}
    assert "--schedule " not in result.stdout
    assert len(flags) < len(listed_flags(run_cli(["train", "--help"]).stdout)) / 2


def test_model_help_shows_each_subcommand_and_its_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["model", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "verst model init [-h] --arch {qwen3,qwen3-moe,llama} --size {tiny,small} --out OUT [--seed SEED]" in out
    assert "verst model get [-h] --out OUT [--cache CACHE] {smollm2-135m-instruct}" in out
    assert "verst model import [-h] --gguf GGUF --out OUT" in out
    for argument in ("--seed SEED           weight initialisation seed (default: 0)", "--cache CACHE",
                     "--gguf GGUF  the .gguf file"):
        assert argument in out


def test_dry_run_prints_config_and_arithmetic_without_torch(tmp_path, tiny_model_dir, addition_data_dir):
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "dry"\n[rollout]\nbatch_size = 4\nn_samples_per_prompt = 4\n[trainer]\nglobal_batch_size = 8\n')
    paths = ["--model.path", str(tiny_model_dir), "--data.train-path", str(addition_data_dir / "train.jsonl"),
             "--data.test-path", str(addition_data_dir / "test.jsonl"), "--run-dir", str(tmp_path / "runs" / "dry")]
    result = run_cli(["train", str(recipe), "--dry-run", "--rollout.num-rollouts", "10", *paths])
    assert result.returncode == 0, result.stderr
    assert "name: dry" in result.stdout
    assert "train_steps_per_rollout = 2" in result.stdout
    assert "total_train_steps = 20" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_bad_config_exits_2_naming_field():
    result = run_cli(["train", "--dry-run", "--rollout.batch-size", "-3"])
    assert result.returncode == 2
    assert "rollout.batch_size: Input should be greater than or equal to 1 (got -3)" in result.stderr


def test_console_script_installed():
    import shutil
    from pathlib import Path

    exe = Path(sys.executable).parent / "verst"
    assert exe.exists() or shutil.which("verst"), "the verst console script is not installed"
    result = subprocess.run([str(exe) if exe.exists() else "verst", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage: verst" in result.stdout


def test_plugins_import_from_the_working_directory(tmp_path, monkeypatch):
    """`verst sft recipe.toml` naming `examples.calc.agent:run` resolves it from the cwd, as `python -m` would
    (a console script's sys.path starts at its own bin directory)."""
    (tmp_path / "my_plugin_for_cli_test.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(SystemExit):
        main(["data", "--help"])
    from verst.config import load_object

    assert load_object("my_plugin_for_cli_test:VALUE", "reward.path") == 7
