"""RL runs with `cluster.engine = "sglang"` on Ray, against the SGLang mock (`tests/sglang_mock.py`): verst's
launcher starts it as it starts SGLang, and every request the run makes passes SGLang 0.5.9's request schema.
Colocated sync runs release and resume the engines' memory around each train step; the distributed
transport and routing replay, and a LoRA adapter's disk sync (unload, then load), run through it too."""

from __future__ import annotations

import json
import os

import pytest

from tests.e2e.test_rl_schedules import REPO, check_run, rl_config, run_schedule
from tests.moe_models import near_tie_moe
from tests.sglang_mock import LOG_ENV, mock_sglang_python


@pytest.fixture(scope="module")
def mock_log(tmp_path_factory):
    """A Ray session whose actors import this checkout and write the mock's request log here."""
    from verst.orchestration import RaySession

    log = tmp_path_factory.mktemp("sglang-mock") / "requests.jsonl"
    old = {k: os.environ.get(k) for k in (LOG_ENV, "PYTHONPATH")}
    os.environ[LOG_ENV] = str(log)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), old["PYTHONPATH"]]))
    try:
        with RaySession(slots=4, log_to_driver=False):
            yield log
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sglang_args(tmp_path, *flags):
    return ["--cluster.engine", "sglang", "--cluster.engine-python", mock_sglang_python(tmp_path / "mock"),
            *(f"--sglang.{flag}" for flag in flags)]


def paths_of(log) -> list[str]:
    entries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.write_text("")  # the next test reads its own requests
    return [entry["path"] for entry in entries]


def test_sync_colocated_on_sglang_releases_memory_around_each_train_step(mock_log, tiny_model_dir, addition_data_dir,
                                                                         tmp_path):
    paths_of(mock_log)
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--cluster.placement",
                    "colocated", "--sync.transport", "tensor", "--sync.check-weights", "true",
                    *sglang_args(tmp_path, "enable-memory-saver"))
    records = check_run(cfg, run_schedule(cfg), steps=2)
    # the weight check's probes, sampled by the mock on the pushed weights, equal the trainer's logprobs
    assert [r["sync/check_max_abs_diff"] for r in records if "sync/check_max_abs_diff" in r][0] <= 1e-4
    paths = paths_of(mock_log)
    cycle = [p for p in paths if p in ("/release_memory_occupation", "/resume_memory_occupation",
                                       "/update_weights_from_tensor")]
    # each step: the memory goes to the trainer and comes back before the new weights are loaded
    assert cycle == ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor"] * 2
    assert {"/health", "/generate", "/pause_generation", "/continue_generation", "/model_info"} <= set(paths)


def test_distributed_sync_and_routing_replay_on_sglang(mock_log, addition_data_dir, tmp_path):
    paths_of(mock_log)
    moe = near_tie_moe(tmp_path / "moe")
    cfg = rl_config(tmp_path, moe, addition_data_dir, "--schedule", "one_step_off", "--sync.transport", "distributed",
                    "--algorithm.routing-replay", "replay", "--rollout.max-response-tokens", "8",
                    *sglang_args(tmp_path))
    records = check_run(cfg, run_schedule(cfg), steps=2)
    train = [r for r in records if "train/loss" in r]
    # the experts the mock returned (SGLang's layout) reach the trainer, which replays them
    drift = max(max(r["train/mismatch_ratio_max"] - 1, 1 - r["train/mismatch_ratio_min"]) for r in train)
    assert all(r["train/routing_mismatch_rate"] > 0 for r in train) and drift < 1e-6
    paths = paths_of(mock_log)
    assert paths.count("/init_weights_update_group") == 1 and "/update_weights_from_distributed" in paths


def test_lora_adapter_disk_sync_on_sglang_unloads_then_loads(mock_log, tiny_model_dir, addition_data_dir, tmp_path):
    paths_of(mock_log)
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--lora.enabled", "true", "--lora.rank", "4", "--lora.target-modules", "[q_proj, v_proj]",
                    "--trainer.lr", "1e-2", *sglang_args(tmp_path, "enable-lora"))
    check_run(cfg, run_schedule(cfg), steps=2)
    lora = [p for p in paths_of(mock_log) if p.endswith("_lora_adapter")]
    # SGLang loads a name once: every push after the first unloads the adapter it replaces
    assert lora[-4:] == ["/unload_lora_adapter", "/load_lora_adapter"] * 2
