import json
import subprocess
import sys

import pytest

from verst.cli.main import main
from verst.config import load_config
from verst.monitor import MetricsLogger, prepare_run_dir, read_metrics, write_summary
from verst.monitor.report import write_report


def test_run_dir_metrics_summary_and_report(tmp_path, capsys):
    cfg = load_config(None, ["--name", "t", "--run-dir", str(tmp_path / "run")])
    run = prepare_run_dir(cfg)
    assert "name: t" in (run / "config.yaml").read_text()
    with MetricsLogger.for_run(run, tensorboard=True) as logger:
        for step in range(3):
            logger.log({"train/loss": 1.0 / (step + 1), "rollout/reward_mean": 0.1 * step}, step=step)
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["train/loss"] == pytest.approx(1 / 3)
    assert tensorboard_scalars(run / "tensorboard") == {
        (step, "train/loss"): pytest.approx(1.0 / (step + 1)) for step in range(3)
    } | {(step, "rollout/reward_mean"): pytest.approx(0.1 * step) for step in range(3)}
    write_summary(run, {"eval/accuracy_after": 0.5, "bad": float("nan")})
    assert json.loads((run / "summary.json").read_text())["eval/accuracy_after"] == 0.5

    assert main(["report", str(run)]) == 0
    report = run / "report.html"
    assert str(report) in capsys.readouterr().out
    text = report.read_text()
    assert "<h2>Overview</h2>" in text and 'id="reward"' in text and 'id="m-train-loss"' in text
    assert "eval/accuracy_after" in text and "Plotly.newPlot" in text  # plotly.js inline: one file


def tensorboard_scalars(log_dir):
    """{(step, tag): value} of every scalar in the run's event files, read by TensorBoard's own loader."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    scalars = {}
    for path in log_dir.iterdir():
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                scalars[event.step, value.tag] = value.simple_value
    return scalars


def test_the_tensorboard_sink_imports_no_torch(tmp_path):
    code = ("import sys; from verst.monitor import MetricsLogger; "
            f"logger = MetricsLogger.for_run({str(tmp_path)!r}, tensorboard=True); "
            "logger.log({'train/loss': 0.5}, step=1); logger.close(); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
    assert tensorboard_scalars(tmp_path / "tensorboard") == {(1, "train/loss"): 0.5}


def test_logger_rejects_bad_keys_and_values(tmp_path):
    logger = MetricsLogger.for_run(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match="metric key 'loss' must start with one of"):
        logger.log({"loss": 1.0}, step=0)
    with pytest.raises(ValueError, match="metric 'train/loss' has non-numeric value 'x'"):
        logger.log({"train/loss": "x"}, step=0)
    logger.close()


def test_report_missing_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")
