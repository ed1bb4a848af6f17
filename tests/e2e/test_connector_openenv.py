"""The OpenEnv connector end to end on the tiny model: episodes of the stand-in arithmetic environment
(examples/openenv, openenv-core's own server and client) through the session server to a real embedded
engine. The trained trajectory is exactly the engine's ids, with the loss mask on the model's turns only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("openenv.core", reason="the OpenEnv connector needs `pip install 'verst[openenv]'`")

from examples.openenv.env import MAX_ATTEMPTS  # noqa: E402
from examples.openenv.make_data import make_data  # noqa: E402
from tests.agent_accounting import assert_engine_tokens, run_episodes  # noqa: E402
from verst.config import SamplingConfig, load_config  # noqa: E402
from verst.data import load_prompts  # noqa: E402
from verst.models.tokenizer import VOCAB_SIZE  # noqa: E402
from verst.types import Status  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


def test_openenv_episodes_train_on_the_engines_tokens(tiny_model_dir, tmp_path):
    cfg = load_config(REPO / "recipes" / "grpo_openenv.toml", ["--model.path", str(tiny_model_dir)])
    # every token id ends a turn with finish_reason "stop": one-token answers, so each episode runs all
    # MAX_ATTEMPTS steps and the environment's feedback lies between the model's turns
    rollout = cfg.rollout.model_copy(update={"sampling": SamplingConfig(seed=3, stop_token_ids=list(range(VOCAB_SIZE)))})
    cfg = cfg.model_copy(update={"rollout": rollout})
    prompts = load_prompts(make_data(tmp_path / "data", n_train=2, n_test=1)["train"])
    for sample, calls in run_episodes(cfg, tiny_model_dir, prompts):
        assert sample.status is Status.COMPLETED, sample.metadata
        meta = sample.metadata
        assert meta["agent_end"] == "done" and meta["openenv_done"] is True
        assert len(calls) == meta["agent_turns"] == MAX_ATTEMPTS == len(meta["openenv_rewards"])
        assert sample.reward == meta["openenv_reward"] == 0.0  # one-token answers never hit a two-digit sum
        assert_engine_tokens(sample, calls)
        assert 0 < sum(sample.loss_mask) < sample.response_length  # the feedback turns carry no loss
