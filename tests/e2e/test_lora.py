"""LoRA end to end on the tiny model: an RL run on Ray (sync schedule, weight check) stopped and resumed,
with the adapter synced alone (the engines serve it by name on their base) or the merged weights, and an
SFT run; only the adapters train, the exports load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from tests.e2e.test_rl_schedules import ray_session, rl_config, run_schedule  # noqa: F401  (the module's Ray session)
from tests.e2e.test_sft import sft_args
from verst.cli.main import main
from verst.monitor import read_metrics

LORA = ("--lora.enabled", "true", "--lora.rank", "4", "--lora.target-modules", "[q_proj, v_proj, up_proj]",
        "--trainer.lr", "1e-2", "--checkpoint.merge-lora", "true")
PROBE = torch.tensor([[49, 50, 43, 51, 52, 61, 72, 105, 33, 65, 66]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits


def check_exports(run_dir: Path, base_dir: Path, targets: tuple[str, ...]) -> None:
    """hf/ is a PEFT adapter on the base, hf/merged the same model as a full checkpoint; only the targeted
    linear weights differ from the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf" / "merged", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                        str(run_dir / "hf"))
    torch.testing.assert_close(logits(adapted), logits(merged), atol=1e-5, rtol=0)
    base, new = load_file(base_dir / "model.safetensors"), load_file(run_dir / "hf" / "merged" / "model.safetensors")
    assert set(new) == set(base)
    changed = {name for name in base if not torch.equal(base[name], new[name])}
    assert changed and all(name.split(".")[-2] in targets for name in changed), sorted(changed)


def adapter_only(trainer_dir: Path) -> None:
    keys = dcp.FileSystemReader(str(trainer_dir / "dcp")).read_metadata().state_dict_metadata
    tensors = [key for key in keys if key.startswith(("model.", "optimizer.state."))]
    assert tensors and all("lora_" in key for key in tensors), tensors[:5]


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_rl_serves_the_trained_policy_and_resumes(sync, ray_session, tiny_model_dir, addition_data_dir,  # noqa: F811
                                                       tmp_path):
    # The untrained model earns no reward (zero advantages): the entropy bonus is what moves the adapters.
    # The KL loss reads the reference: the base, its adapters disabled.
    common = ("--schedule", "sync", "--sync.transport", "distributed", "--sync.check-weights", "true",
              "--algorithm.entropy-coef", "0.1", "--algorithm.kl-loss-coef", "0.01", "--lora.sync", sync, *LORA)
    first = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *common, "--rollout.num-rollouts", "1")
    assert run_schedule(first)["train/steps"] == 1
    resumed = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *common, "--rollout.num-rollouts", "2",
                        "--checkpoint.load", first.run_dir)
    assert run_schedule(resumed)["train/steps"] == 2  # the restore pushed the step-1 weights first
    run_dir = Path(first.run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["train/loss"]) for r in train)
    # Engines and trainer agree on the policy (base + adapter): the weight check after the first sync, and the
    # rollout logprobs of step 2 (sampled by version 1, pushed by the restore) against the trainer's.
    checks = [r["sync/check_max_abs_diff"] for r in records if "sync/check_max_abs_diff" in r]
    assert checks and max(checks) < 1e-4, checks
    assert all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in train), [r["train/rollout_logprob_abs_diff"]
                                                                            for r in train]
    adapter_bytes = sum(t.numel() * t.element_size() for t in load_file(run_dir / "hf" / "adapter_model.safetensors").values())
    base_bytes = sum(t.numel() * t.element_size() for t in load_file(tiny_model_dir / "model.safetensors").values())
    # adapter sync moves the adapter's bytes (float32, as the export); merged sync the whole model
    assert all(r["sync/bytes"] == (adapter_bytes if sync == "adapter" else base_bytes) for r in train), (
        [r["sync/bytes"] for r in train], adapter_bytes, base_bytes)
    adapter_only(run_dir / "checkpoints" / "step_2" / "trainer")
    check_exports(run_dir, tiny_model_dir, ("q_proj", "v_proj", "up_proj"))


def test_lora_sft_trains_the_adapters_and_resumes(tiny_model_dir, addition_data_dir, tmp_path):
    run = tmp_path / "run"
    common = ("--sft.batch-size", "8", "--eval.max-prompts", "4", "--checkpoint.interval", "1", *LORA)
    assert main(sft_args(tiny_model_dir, addition_data_dir, run, "--sft.num-steps", "2", *common)) == 0
    assert main(["sft", "--resume", str(run), "--sft.num-steps", "3"]) == 0
    losses = [r["train/loss"] for r in read_metrics(run) if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    adapter_only(run / "checkpoints" / "step_3" / "trainer")
    check_exports(run, tiny_model_dir, ("q_proj", "v_proj", "up_proj"))
