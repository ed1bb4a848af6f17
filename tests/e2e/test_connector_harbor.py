"""The Harbor connector end to end on the tiny model: a Harbor trial (harbor's Trial, task loader and
verifier) in Harbor's own environment (.venv-harbor, `make agents`), with the stand-in answer agent (harbor's
BaseAgent and LiteLLM client) in the stand-in host environment (harbor's BaseEnvironment; no container
runtime here), its model the session server. The trained trajectory is exactly the engine's ids, with the
loss mask on the model's turns only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from examples.harbor.make_data import make_data
from tests.agent_accounting import assert_engine_tokens, run_episodes
from verst.config import load_config
from verst.connectors.harbor import DEFAULT_PYTHON, PYTHON_ENV
from verst.data import load_prompts
from verst.types import Status

REPO = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get(PYTHON_ENV) or REPO / DEFAULT_PYTHON)
pytestmark = pytest.mark.skipif(not PYTHON.is_file(), reason=f"no Harbor environment at {PYTHON}; `make agents`")
torch.set_num_threads(1)


def test_harbor_trial_trains_on_the_engines_tokens(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # where the trial process imports examples.harbor.* from
    monkeypatch.setenv(PYTHON_ENV, str(PYTHON))
    cfg = load_config(REPO / "recipes" / "grpo_harbor.toml", ["--model.path", str(tiny_model_dir)])
    prompts = load_prompts(make_data(tmp_path / "data", n_train=1, n_test=1)["train"])
    [(sample, calls)] = run_episodes(cfg, tiny_model_dir, prompts)
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.metadata
    meta = sample.metadata
    assert meta["harbor_exception"] is None and meta["harbor_rewards"] == {"reward": 0}
    assert sample.reward == 0.0  # random weights do not add
    # three turns: each reply was checked and the checker's verdict sent back
    assert len(calls) == meta["harbor_agent"]["turns"] == 3 and meta["harbor_agent"]["last_check"] != "correct"
    assert_engine_tokens(sample, calls)
    assert 0 < sum(sample.loss_mask) < sample.response_length  # the checker's messages carry no loss
