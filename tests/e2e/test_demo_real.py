"""`make demo-real` shortened to 16 of its 30 steps: GRPO on SmolLM2-135M-Instruct raises held-out accuracy
(`make test-slow`; the first run also downloads and converts the model into artifacts/)."""

import json
from pathlib import Path

import pytest

from examples import demo_real
from verst.models import load_model, load_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_demo_real_shortened_raises_accuracy(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the demo's artifacts and recipe paths are relative to the repository
    run = tmp_path / "run"
    rc = demo_real.main(["--run-dir", str(run), "--rollout.num-rollouts", "16", "--eval.interval", "0",
                         "--logging.progress", "false", "--logging.tensorboard", "false"])
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["train/steps"] == 16
    assert summary["eval/accuracy_after"] > summary["eval/accuracy_before"]
    assert "GRPO (fully async, 16 steps)" in capsys.readouterr().out
    # The export round-trips: transformers loads it, with the model's own ChatML template.
    exported = load_model(run / "hf")
    assert exported.config.vocab_size == 49152 and exported.config.tie_word_embeddings
    assert "<|im_start|>" in load_tokenizer(run / "hf").chat_template
