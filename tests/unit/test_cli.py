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


@pytest.mark.parametrize("command", ["train", "sft"])
def test_config_command_help_lists_every_field_without_torch(command):
    result = run_cli([command, "--help"])
    assert result.returncode == 0, result.stderr
    for dotted, _, default, doc in iter_fields():
        flag = f"--{dotted.replace('_', '-')} "
        assert flag in result.stdout, flag
        assert doc in result.stdout
        assert f"(default: {default!r})" in result.stdout


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
