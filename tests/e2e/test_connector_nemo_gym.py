"""The NeMo Gym connector end to end: NeMo Gym's simple agent, the stand-in `add` resources server
(examples/nemo_gym) and NeMo Gym's vllm_model server run in NeMo Gym's own environment (.venv-nemo-gym,
`make agents`), their policy model the session server. On the tiny model (a random model answers in one
turn) and on a scripted engine that calls the tool first: the trained trajectory is exactly the engine's
ids, with the loss mask on the model's turns only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.nemo_gym.make_data import make_data
from tests.agent_accounting import assert_engine_tokens, run_episodes, run_scripted_episodes
from verst.config import load_config
from verst.connectors.nemo_gym import DEFAULT_PYTHON, PYTHON_ENV
from verst.data import load_prompts
from verst.types import Status

REPO = Path(__file__).resolve().parents[2]
PYTHON = Path(__import__("os").environ.get(PYTHON_ENV) or REPO / DEFAULT_PYTHON)
pytestmark = pytest.mark.skipif(not PYTHON.is_file(), reason=f"no NeMo Gym environment at {PYTHON}; `make agents`")
torch.set_num_threads(1)


@pytest.fixture()
def nemo_gym_run(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # where the episode process imports examples.nemo_gym.resources from
    monkeypatch.setenv(PYTHON_ENV, str(PYTHON))
    prompts = load_prompts(make_data(tmp_path / "data", n_train=2, n_test=1)["train"])
    return lambda max_tokens: load_config(REPO / "recipes" / "grpo_nemo_gym.toml", [
        "--model.path", str(tiny_model_dir), "--rollout.max-response-tokens", str(max_tokens)]), prompts


def test_nemo_gym_episodes_on_the_tiny_model(nemo_gym_run, tiny_model_dir):
    config, prompts = nemo_gym_run
    for sample, calls in run_episodes(config(16), tiny_model_dir, prompts):
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.metadata
        assert sample.reward == sample.metadata["nemo_gym_reward"] == 0.0  # random weights answer nothing right
        assert len(calls) == 1  # no tool call: the simple agent stops after the first reply
        assert_engine_tokens(sample, calls)


def test_nemo_gym_tool_episode_masks_the_tool_output(nemo_gym_run, tiny_model_dir):
    config, prompts = nemo_gym_run
    for sample, calls in run_scripted_episodes(config(96), tiny_model_dir, [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "The sum is 3."], prompts[:1]):
        assert sample.status is Status.COMPLETED, sample.metadata
        assert len(calls) == 2 and sample.reward == 0.0  # the scripted answer is not this row's sum
        outputs = sample.metadata["nemo_gym_output"]
        assert [o["type"] for o in outputs] == ["function_call", "function_call_output", "message"]
        assert json.loads(outputs[1]["output"]) == {"sum": 3}  # the resources server ran the tool
        assert_engine_tokens(sample, calls)
        assert 0 < sum(sample.loss_mask) < sample.response_length  # the tool output carries no loss
