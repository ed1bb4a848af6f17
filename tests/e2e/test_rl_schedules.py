"""A few steps of each schedule with each weight transport that applies to it, on Ray, with the tiny
model: engines (behind sglang-router when there are two), FSDP2 trainer rank actors, weight sync, held-out evaluation."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.metrics_doc import undocumented
from verst.config import ConfigError, load_config
from verst.monitor import read_metrics
from verst.monitor.samples import read_samples
from verst.run.cores import core_layout
from verst.schedules import SCHEDULES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    from verst.orchestration import RaySession

    record_dir = tmp_path_factory.mktemp("records")
    old = {k: os.environ.get(k) for k in ("VERST_TEST_RECORD_DIR", "PYTHONPATH")}
    # Actors inherit this environment: they load tests/e2e/rl_plugins.py by import path.
    os.environ["VERST_TEST_RECORD_DIR"] = str(record_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), old["PYTHONPATH"]]))
    try:
        with RaySession(slots=4, log_to_driver=False):
            yield record_dir
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rl_config(tmp_path, model_dir, data_dir, *overrides):
    return load_config(None, rl_args(tmp_path, model_dir, data_dir, *overrides))


def rl_args(tmp_path, model_dir, data_dir, *overrides, quiet=True):
    """quiet: no TensorBoard files and no progress display (both on by default)."""
    logging = ["--logging.tensorboard", "false", "--logging.progress", "false"] if quiet else []
    return [
        "--name", "e2e", "--run-dir", str(tmp_path / "run"),
        "--model.path", str(model_dir),
        "--data.train-path", str(data_dir / "train.jsonl"), "--data.test-path", str(data_dir / "test.jsonl"),
        "--data.apply-chat-template", "false",
        "--rollout.batch-size", "4", "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "2",
        "--rollout.max-response-tokens", "4", "--trainer.lr", "1e-4",
        "--eval.max-prompts", "8", *logging, *overrides,
    ]


def run_schedule(cfg):
    return asyncio.run(SCHEDULES[cfg.schedule](cfg))


def check_run(cfg, summary, steps, steps_per_rollout=1):
    run_dir = Path(cfg.run_dir)
    assert summary["train/steps"] == steps
    assert summary["eval/version_before"] == 0 and summary["eval/version_after"] == steps
    assert json.loads((run_dir / "summary.json").read_text())["sync/transport"] == cfg.sync.transport
    records = read_metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        assert r["sync/version"] == r["step"]  # every step's weights reached the engines
        assert r["sync/seconds"] > 0 and r["sync/bytes"] > 0
        assert "perf/step_time_s" in r
        # a rollout batch's metrics go with its first step
        assert ("rollout/reward_mean" in r) == ((r["step"] - 1) % steps_per_rollout == 0)
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["eval/weight_version"] for r in evals] == [0, steps]
    phases = {f"time/startup/{p}_s" for p in ("ray", "engines", "rollout_manager", "syncer")}
    first = records[0]  # start-up is logged with the step-0 evaluation, in the same record
    assert first["step"] == 0 and "eval/accuracy" in first and phases <= set(first), sorted(first)
    assert first["time/startup_s"] == pytest.approx(sum(first[k] for k in phases))
    # the trainer ranks start meanwhile, in the background; the first step logs when they were ready
    run_start = first["time"] - first["time/eval_s"] - first["time/startup_s"]  # the step-0 evaluation came next
    assert 0 < train[0]["time/startup/trainer_s"] < train[0]["time"] - run_start + 1.0
    assert all("time/startup/trainer_s" not in r for r in train[1:])
    # the threads and cores each side had (the core budget on CPU); a re-split needs two steps measured first.
    # A run on a Ray cluster has none: its processes are placed on the cluster's nodes.
    layout = core_layout(cfg, "cpu")
    if layout is None:
        assert not any(k.endswith(("_threads", "_cores")) for r in train for k in r if k.startswith("perf/")), train[0]
    else:
        planned = layout.plan().metrics()
        assert {k: train[0][k] for k in planned} == planned
    assert (run_dir / "report.html").exists()
    assert undocumented(records) == []  # every logged key has its line in docs/metrics.md
    samples = read_samples(run_dir)  # the report's sample generations: each rollout batch's first groups
    assert set(samples) == {r["step"] for r in train if "rollout/reward_mean" in r}
    assert all(isinstance(x["response"], str) and x["reward"] is not None for rows in samples.values() for x in rows)
    return records


def test_names_registered_by_plugins_work_in_every_process_of_a_run(ray_session, tiny_model_dir, addition_data_dir,
                                                                     tmp_path, registries_restored):
    """`plugins` is imported by the rollout manager (which scores with the registered reward) and the trainer
    ranks (which compute the registered advantages): looked up anywhere it is not, either name fails the run."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--plugins", "[examples.plugins.registered]", "--algorithm.advantage-estimator",
                    "median_baseline", "--reward.type", "answer_then_stop")
    check_run(cfg, run_schedule(cfg), steps=2)


@pytest.mark.parametrize("schedule, placement, transport", [
    ("sync", "disaggregated", "disk"),
    ("one_step_off", "disaggregated", "distributed"),
    ("one_step_off", "disaggregated", "disk"),
    ("one_step_off", "colocated", "tensor"),
    ("fully_async", "disaggregated", "disk"),
])
def test_schedule_with_transport(ray_session, tiny_model_dir, addition_data_dir, tmp_path, schedule, placement,
                                 transport):
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", schedule,
                    "--cluster.placement", placement, "--sync.transport", transport)
    check_run(cfg, run_schedule(cfg), steps=2)


def test_sync_colocated_two_steps_per_rollout(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    """Two optimizer steps per rollout batch, engines freeing memory around each: the old logprobs are
    recomputed once per rollout, before its first step (the step's own forward serves one-step batches)."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync",
                    "--cluster.placement", "colocated", "--sync.transport", "tensor",
                    "--trainer.global-batch-size", "8")
    records = check_run(cfg, run_schedule(cfg), steps=4, steps_per_rollout=2)
    train = [r for r in records if "train/loss" in r]
    assert all(r["time/logprob_s"] > 0 for r in train[::2])  # the recompute, on each rollout's first step


def test_sync_with_the_mismatch_corrections_and_options_on(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    """IcePop, off-policy sequence masking, advantage whitening and the importance-weighted KL in one run:
    the loss stays finite and each correction's metrics are logged (and documented, by check_run)."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--sync.transport", "disk",
                    "--algorithm.mismatch-correction", "icepop", "--algorithm.tis-clip-low", "0.5",
                    "--algorithm.opsm-delta", "0.0", "--algorithm.whiten-advantages", "true",
                    "--algorithm.kl-loss-coef", "0.01", "--algorithm.kl-importance-weighted", "true")
    records = check_run(cfg, run_schedule(cfg), steps=2)
    keys = ("train/loss", "train/kl", "train/mis_reject_frac", "train/opsm_masked_frac", "train/ess_ratio",
            "train/mismatch_ratio_mean", "train/mismatch_ratio_max", "train/mismatch_ratio_min")
    for r in (r for r in records if "train/loss" in r):
        assert all(math.isfinite(r[k]) for k in keys), {k: r.get(k) for k in keys}
        assert 0.0 < r["train/ess_ratio"] <= 1.0
        assert r["train/mismatch_ratio_min"] <= r["train/mismatch_ratio_mean"] <= r["train/mismatch_ratio_max"]


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "fully_async"])
def test_ppo_trains_its_critic_on_the_schedule(ray_session, tiny_model_dir, addition_data_dir, tmp_path, schedule):
    """PPO with a critic on the trainer ranks: every step logs the critic's metrics, and the value loss falls
    as the critic, starting at 0, fits returns near 1."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", schedule, "--sync.transport", "disk",
                    "--algorithm.advantage-estimator", "ppo", "--algorithm.whiten-advantages", "true",
                    "--critic.lr", "3e-3", "--rollout.num-rollouts", "4",
                    "--reward.type", "custom", "--reward.path", "tests.e2e.rl_plugins:non_digit_share")
    records = check_run(cfg, run_schedule(cfg), steps=4)
    train = [r for r in records if "train/loss" in r]
    keys = ("train/value_loss", "train/value_clipfrac", "train/value_mean", "train/value_grad_norm", "train/value_lr")
    assert all(math.isfinite(r[k]) for r in train for k in keys), [{k: r.get(k) for k in keys} for r in train]
    assert train[0]["train/value_mean"] == 0.0  # the zero-initialised value head
    assert train[-1]["train/value_loss"] < train[0]["train/value_loss"], [r["train/value_loss"] for r in train]
    assert (Path(cfg.run_dir) / "hf" / "config.json").exists()


def test_sync_two_ranks_two_engines_with_weight_check(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync",
                    "--sync.transport", "distributed", "--sync.check-weights", "true",
                    "--cluster.trainer-ranks", "2", "--cluster.num-engines", "2")
    records = check_run(cfg, run_schedule(cfg), steps=2)
    assert any(k.startswith("sync/check") for k in records[1]), sorted(records[1])


def test_fully_async_staleness_drops_and_return_to_source(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    """max_staleness 0 with the buffer filled regardless (admission fill): groups made before a train step are
    stale after it."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "fully_async",
                    "--sync.transport", "distributed", "--rollout.num-rollouts", "3",
                    "--buffer.max-staleness", "0", "--rollout.admission", "fill", "--buffer.capacity-factor", "3",
                    "--buffer.unused", "return",
                    "--buffer.path", "tests.e2e.rl_plugins:RecordingBuffer",
                    "--data.source", "tests.e2e.rl_plugins:counting_source")
    records = check_run(cfg, run_schedule(cfg), steps=3)
    discarded = [json.loads(line) for line in (ray_session / "discarded.jsonl").read_text().splitlines()]
    stale = [d for d in discarded if d["reason"] == "stale"]
    assert stale, "max_staleness 0 with a full buffer must drop stale groups"
    # Stale groups are discarded only by take, and every take is followed by a metrics read: the last
    # logged cumulative count equals the groups the buffer actually discarded as stale.
    assert max(r["buffer/dropped_stale_total"] for r in records if "buffer/dropped_stale_total" in r) == len(stale)
    returned = [json.loads(line) for line in (ray_session / "returned.jsonl").read_text().splitlines()]
    assert {d["group"] for d in stale} <= {g for r in returned for g in r["groups"]}  # their prompts went back


def test_fully_async_colocated_is_refused(tiny_model_dir, addition_data_dir, tmp_path):
    with pytest.raises(ConfigError, match="'fully_async' with cluster.placement = 'colocated' is refused"):
        rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "fully_async",
                  "--cluster.placement", "colocated")


# A run whose driver fails on any torch import: torch loads only in the trainer ranks and the engines.
DRIVER_WITHOUT_TORCH = """
import asyncio, importlib.abc, importlib.machinery, sys

class NoTorch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # found (transformers asks whether torch is installed), but never loaded
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        raise ImportError(f"the driver imported {spec.name}")

sys.meta_path.insert(0, NoTorch())
from verst.config import load_config
from verst.schedules import SCHEDULES

cfg = load_config(None, sys.argv[1:])
summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
print("steps", summary["train/steps"], "torch" in sys.modules)
"""


def test_the_driver_of_a_run_imports_no_torch(tiny_model_dir, addition_data_dir, tmp_path):
    """The driver only passes references to the groups and control calls: train steps and weight pushes
    run in the ranks, so its imports stay off a small machine's start-up (and off a GPU cluster's head node)."""
    args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "fully_async", quiet=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", DRIVER_WITHOUT_TORCH, *args], capture_output=True, text=True,
                          timeout=280, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "steps 2 False"
    assert any((tmp_path / "run" / "tensorboard").iterdir())  # the default sinks wrote without torch
