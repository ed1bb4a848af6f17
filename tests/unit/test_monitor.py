import json

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
    assert any((run / "tensorboard").iterdir())
    write_summary(run, {"eval/accuracy_after": 0.5, "bad": float("nan")})
    assert json.loads((run / "summary.json").read_text())["eval/accuracy_after"] == 0.5

    assert main(["report", str(run)]) == 0
    report = run / "report.html"
    assert str(report) in capsys.readouterr().out
    text = report.read_text()
    assert "<h2>Overview</h2>" in text and 'id="reward"' in text and 'id="m-train-loss"' in text
    assert "eval/accuracy_after" in text and "Plotly.newPlot" in text  # plotly.js inline: one file


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
