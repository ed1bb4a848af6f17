"""On-policy distillation end to end on Ray with the tiny model: a teacher engine of its own scores every
sample in one prefill, the samples carry its logprobs to the trainer, and the distillation term is logged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.e2e.test_rl_schedules import check_run, ray_session, rl_config, run_schedule  # noqa: F401 (fixture)
from verst.models import init_model
from verst.models.loader import load_model_and_tokenizer
from verst.types import decode_samples


@pytest.mark.usefixtures("ray_session")
def test_pure_distillation_scores_every_sample_on_the_teacher(tiny_model_dir, addition_data_dir, tmp_path):
    teacher_dir = init_model("qwen3", "tiny", tmp_path / "teacher", seed=1)  # other weights, same tokenizer
    dumps = tmp_path / "dumps"
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--teacher.model-path", str(teacher_dir), "--algorithm.distill-coef", "1.0",
                    "--algorithm.reward-coef", "0", "--rollout.dump-dir", str(dumps))
    records = check_run(cfg, run_schedule(cfg), steps=2)
    train = [r for r in records if "train/loss" in r]
    for r in train:
        assert math.isfinite(r["train/distill_kl"]) and math.isfinite(r["rollout/teacher_kl"])
        assert r["rollout/teacher_score_seconds"] > 0
    assert any(r["train/distill_kl"] != 0 for r in train)
    assert (Path(cfg.run_dir) / "logs" / "teacher-0.log").exists()
    # The teacher's logprobs the samples carried are the teacher model's own, on exactly the sampled tokens.
    teacher, _ = load_model_and_tokenizer(teacher_dir)
    samples = [s for path in sorted(dumps.glob("*.samples")) for s in decode_samples(path.read_bytes())]
    assert len(samples) == 2 * 4 * 4
    for s in samples[::5]:
        assert s.teacher_logprobs is not None and len(s.teacher_logprobs) == s.response_length
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([s.tokens])).logits[0].double()
        lp = torch.log_softmax(logits, -1)[s.prompt_length - 1 : -1].gather(
            1, torch.tensor(s.response_tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.teacher_logprobs, dtype=torch.float64), lp, atol=1e-4, rtol=0)
