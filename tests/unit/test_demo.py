"""The demo job's glue: the RL recipe it runs, the SFT export it starts from, and its refusal when
RL did not run (the job itself is exercised by `make demo`)."""

from __future__ import annotations

import pytest

from examples import demo
from verst.config import batch_plan, load_config


def test_rl_recipe_is_fully_async_on_one_trainer_rank_and_one_engine():
    cfg = load_config(demo.RL_RECIPE)  # its rules (batch arithmetic among them) hold
    assert cfg.schedule == "fully_async"
    assert (cfg.cluster.trainer_ranks, cfg.cluster.num_engines, cfg.cluster.placement) == (1, 1, "disaggregated")
    assert batch_plan(cfg).total_train_steps > 0
    assert cfg.eval.interval > 0


def test_rl_config_starts_from_the_sft_export(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert demo.rl_config(tmp_path).model.path == str(tmp_path / "hf")


def test_rl_config_refuses_a_run_without_an_export(tmp_path):
    with pytest.raises(FileNotFoundError, match="hf"):
        demo.rl_config(tmp_path)


def test_summary_check_returns_before_and_after():
    summary = {"train/steps": 3, "eval/accuracy_before": 0.2, "eval/accuracy_after": 0.5}
    assert demo.check_rl_summary(summary) == (0.2, 0.5)
    agent = {"train/steps": 3, "eval/success_before": 0.1, "eval/success_after": 0.3}  # a tool-using task's score
    assert demo.check_rl_summary(agent, "eval/success") == (0.1, 0.3)
    with pytest.raises(RuntimeError, match="eval/success_before"):
        demo.check_rl_summary(summary, "eval/success")


@pytest.mark.parametrize("summary", [{"train/steps": 0, "eval/accuracy_before": 0.2, "eval/accuracy_after": 0.2},
                                     {"train/steps": 2, "eval/accuracy_before": 0.2}])
def test_summary_check_fails_when_rl_did_not_run(summary):
    with pytest.raises(RuntimeError):
        demo.check_rl_summary(summary)
