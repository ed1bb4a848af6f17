"""`verst sft` end to end on the tiny model: a few steps here; the accuracy target under `slow`."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.metrics_doc import undocumented
from verst.cli.main import main
from verst.models import load_model
from verst.monitor import read_metrics


def sft_args(model_dir, data_dir, run_dir, *extra, recipe=None):
    return [
        "sft",
        *([recipe] if recipe else []),
        "--model.path", str(model_dir),
        "--data.train-path", str(data_dir / "train.jsonl"),
        "--data.test-path", str(data_dir / "test.jsonl"),
        "--run-dir", str(run_dir),
        "--logging.tensorboard", "false",
        *extra,
    ]


def test_sft_few_steps_writes_run_dir(tiny_model_dir, addition_data_dir, tmp_path):
    run = tmp_path / "run"
    rc = main(sft_args(tiny_model_dir, addition_data_dir, run, "--sft.num-steps", "3", "--sft.batch-size", "16",
                       "--sft.eval-interval", "2", "--eval.max-prompts", "8", "--trainer.lr", "1e-3"))
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert {"eval/accuracy_before", "eval/accuracy_after", "train/loss", "time/total_s"} <= set(summary)
    records = read_metrics(run)
    train_steps = [r["step"] for r in records if "train/loss" in r]
    assert train_steps == [1, 2, 3]
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 3]
    assert undocumented(records) == []  # every logged key has its line in docs/metrics.md
    assert all(r["train/lr"] > 0 and r["train/grad_norm"] > 0 for r in records if "train/loss" in r)
    assert (run / "config.yaml").exists() and any((run / "checkpoints" / "step_3" / "trainer").iterdir())
    exported = load_model(run / "hf")  # transformers loads the export
    assert exported.config.vocab_size == 265
    # Trained with the chat template (the default): the export keeps it.
    assert json.loads((run / "hf" / "tokenizer_config.json").read_text())["chat_template"]


def test_a_model_trained_on_raw_prompts_is_exported_without_chat_template(tiny_model_dir, addition_data_dir, tmp_path):
    run = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, addition_data_dir, run, "--sft.num-steps", "1", "--sft.batch-size", "4",
                         "--eval.max-prompts", "2", "--data.apply-chat-template", "false")) == 0
    assert "chat_template" not in json.loads((run / "hf" / "tokenizer_config.json").read_text())
    assert "chat_template" in json.loads((tiny_model_dir / "tokenizer_config.json").read_text())  # source intact


def test_sft_over_two_rank_actors(tiny_model_dir, addition_data_dir, tmp_path):
    """cluster.trainer_ranks = 2: the ranks start as Ray actors on a local Ray; evaluations read their
    weights, and the checkpoint and export come from them."""
    run = tmp_path / "run"
    rc = main(sft_args(tiny_model_dir, addition_data_dir, run, "--sft.num-steps", "2", "--sft.batch-size", "8",
                       "--eval.max-prompts", "4", "--cluster.trainer-ranks", "2", "--cluster.device", "cpu"))
    assert rc == 0
    records = read_metrics(run)
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    assert all(r["train/grad_norm"] > 0 for r in records if "train/loss" in r)
    assert any((run / "checkpoints" / "step_2" / "trainer").iterdir())
    assert load_model(run / "hf").config.vocab_size == 265


def test_sft_resumes_where_it_stopped(tiny_model_dir, addition_data_dir, tmp_path):
    """`verst sft --resume RUN`: trainer state and data position come back; the losses match a run that
    went through, in the same metrics.jsonl."""
    common = ("--sft.batch-size", "4", "--eval.max-prompts", "2", "--trainer.lr", "1e-3")
    through, stopped = tmp_path / "through", tmp_path / "stopped"
    assert main(sft_args(tiny_model_dir, addition_data_dir, through, "--sft.num-steps", "4", *common)) == 0
    assert main(sft_args(tiny_model_dir, addition_data_dir, stopped, "--sft.num-steps", "2",
                         "--checkpoint.interval", "1", "--checkpoint.keep-last", "1", *common)) == 0
    assert [p.name for p in (stopped / "checkpoints").glob("step_*")] == ["step_2"]
    assert main(["sft", "--resume", str(stopped), "--sft.num-steps", "4"]) == 0
    losses = [{r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r} for run in (through, stopped)]
    assert sorted(losses[1]) == [1, 2, 3, 4]
    for step, loss in losses[0].items():
        assert losses[1][step] == pytest.approx(loss, abs=1e-6), step
    assert main(["sft", "--resume", str(stopped), "--trainer.lr", "2e-3", "--sft.num-steps", "5"]) == 2  # refused by name


@pytest.mark.slow
def test_sft_recipe_reaches_accuracy_target(tiny_model_dir, addition_data_dir, tmp_path):
    """The [trainer] acceptance: the addition SFT recipe lifts held-out accuracy from ~0 to >= 15%."""
    run = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, addition_data_dir, run, recipe="recipes/sft_addition.toml")) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval/accuracy_before"] <= 0.05
    assert summary["eval/accuracy_after"] >= 0.15


def test_sft_resumes_on_another_number_of_ranks(tiny_model_dir, addition_data_dir, tmp_path):
    """`verst sft --resume RUN --cluster.trainer-ranks 1` continues a run saved by two rank actors: the next
    step's loss and the weights after it equal a run that went through on two ranks, within 1e-6 (lr 1e-5:
    each step moves weights by ~1e-5, the float32 order of two ranks' sums by far less)."""
    common = ("--sft.batch-size", "4", "--eval.max-prompts", "2", "--trainer.lr", "1e-5", "--cluster.device", "cpu")
    through, stopped = tmp_path / "through", tmp_path / "stopped"
    assert main(sft_args(tiny_model_dir, addition_data_dir, through, "--sft.num-steps", "3",
                         "--cluster.trainer-ranks", "2", *common)) == 0
    assert main(sft_args(tiny_model_dir, addition_data_dir, stopped, "--sft.num-steps", "2",
                         "--cluster.trainer-ranks", "2", *common)) == 0
    before = load_file(stopped / "hf" / "model.safetensors")  # after step 2; the resumed run exports again
    assert main(["sft", "--resume", str(stopped), "--sft.num-steps", "3", "--cluster.trainer-ranks", "1"]) == 0
    losses = [{r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r} for run in (through, stopped)]
    assert sorted(losses[1]) == [1, 2, 3]
    assert losses[1][3] == pytest.approx(losses[0][3], abs=1e-6)
    after = [load_file(run / "hf" / "model.safetensors") for run in (through, stopped)]
    assert after[0].keys() == after[1].keys() == before.keys()
    assert max(float((after[0][name] - before[name]).abs().max()) for name in before) > 5e-6  # step 3 moved them
    for name, weight in after[0].items():
        torch.testing.assert_close(after[1][name], weight, atol=1e-6, rtol=0, msg=name)
