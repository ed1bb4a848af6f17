"""The agent connectors' own logic, without the agent libraries: the child-process bridge (result, failure
with the child's stderr, timeout), the interpreter lookup, NeMo Gym's task row and the reward fns."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from verst.connectors.child import ChildError, interpreter, run_child
from verst.connectors.harbor import verifier_reward
from verst.connectors.nemo_gym import task_row, verify_reward
from verst.connectors.openenv import env_reward
from verst.rewards import RewardError
from verst.types import Sample

ECHO = """import json, sys
job = json.load(sys.stdin)
if job.get("fail"):
    sys.exit("the episode broke")
if job.get("sleep"):
    import time; time.sleep(job["sleep"])
json.dump({"got": job}, open(sys.argv[1], "w"))
"""


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "episode.py"
    path.write_text(ECHO)
    return path


def child(script, job, timeout_s=30.0):
    return asyncio.run(run_child(Path(sys.executable), script, job, pythonpath=[], timeout_s=timeout_s))


def test_the_child_gets_the_job_and_returns_its_result(script):
    assert child(script, {"base_url": "http://x/v1"}) == {"got": {"base_url": "http://x/v1"}}


def test_a_failed_child_raises_with_its_stderr(script):
    with pytest.raises(ChildError, match=r"(?s)exited with code 1.*the episode broke"):
        child(script, {"fail": True})


def test_a_child_past_its_timeout_is_killed(script):
    with pytest.raises(asyncio.TimeoutError):
        child(script, {"sleep": 30}, timeout_s=0.5)


def test_interpreter_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VERST_TEST_PY", raising=False)
    with pytest.raises(FileNotFoundError, match=r"\.venv-x/bin/python: no Python interpreter for the X connector; "
                                                r"run `make agents`.*VERST_TEST_PY"):
        interpreter(None, "VERST_TEST_PY", ".venv-x/bin/python", "X", "no_such_module_here")
    assert interpreter(None, "VERST_TEST_PY", ".venv-x/bin/python", "X", "json") == Path(sys.executable)
    monkeypatch.setenv("VERST_TEST_PY", sys.executable)
    assert interpreter(None, "VERST_TEST_PY", ".venv-x/bin/python", "X", "no_such_module_here") == Path(sys.executable)


def test_nemo_gym_task_row_takes_the_prompt_and_sampling_settings():
    meta = {"nemo_gym_row": {"responses_create_params": {"tools": []}, "expected": 3}}
    row = task_row("What is 1 + 2?", {"temperature": 0.5, "max_tokens": 8, "logprobs": True}, meta)
    assert row == {"expected": 3, "responses_create_params": {
        "tools": [], "input": [{"role": "user", "content": "What is 1 + 2?"}], "temperature": 0.5,
        "max_output_tokens": 8}}
    assert "input" not in meta["nemo_gym_row"]["responses_create_params"]  # the sample's row is not changed
    with pytest.raises(KeyError, match="nemo_gym_row"):
        task_row("hi", {}, {})


@pytest.mark.parametrize(("fn", "key", "value", "expect"), [
    (env_reward, "openenv_reward", 1.0, 1.0), (env_reward, "openenv_reward", None, 0.0),
    (verify_reward, "nemo_gym_reward", 0.5, 0.5), (verifier_reward, "harbor_reward", 1, 1.0)])
def test_reward_fns_read_their_connectors_result(fn, key, value, expect):
    assert asyncio.run(fn(Sample(prompt="p", metadata={key: value}))) == expect
    with pytest.raises(RewardError, match=key):
        asyncio.run(fn(Sample(prompt="p", metadata={})))


def test_the_token_accounting_check_catches_a_mask_or_id_that_is_not_the_engines():
    from tests.agent_accounting import EngineCall, assert_engine_tokens

    # prompt [1, 2], engine output [3, 4], tool ids [5], engine output [6]
    calls = [EngineCall([1, 2], [3, 4], [-0.1, -0.2]), EngineCall([1, 2, 3, 4, 5], [6], [-0.3])]
    good = Sample(prompt="p", tokens=[1, 2, 3, 4, 5, 6], response_length=4, loss_mask=[1, 1, 0, 1],
                  rollout_logprobs=[-0.1, -0.2, 0.0, -0.3])
    assert_engine_tokens(good, calls)
    for bad, match in (({"loss_mask": [1, 1, 1, 1]}, "loss mask"), ({"tokens": [1, 2, 3, 9, 5, 6]}, "call 0"),
                       ({"rollout_logprobs": [-0.1, -0.2, 0.0, -0.4]}, "logprobs")):
        with pytest.raises(AssertionError, match=match):
            assert_engine_tokens(Sample(**{**good.__dict__, **bad}), calls)
