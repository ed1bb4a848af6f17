"""Checkpoints and resume of RL runs on Ray with the tiny model: a run stopped after step k and resumed
reaches step n with the same metrics and parameters as one that ran through; the final model loads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.e2e.test_rl_schedules import (
    REPO,
    ray_session,  # noqa: F401  (the module's Ray session)
    rl_args,
    rl_config,
    run_schedule,
)
from verst.monitor import read_metrics
from verst.monitor.checkpoint_dirs import CheckpointError, read_latest, read_manifest
from verst.monitor.samples import read_samples

SEEDED = ("--rollout.sampling.seed", "7", "--schedule", "sync", "--sync.transport", "disk")
# Rewards that vary within a group (the addition task's are all 0 for a random model), so advantages and
# gradients; an entropy bonus, so a loss that is not ~0 (GRPO's on-policy policy-gradient loss sums to 0).
SIGNAL = ("--reward.type", "custom", "--reward.path", "tests.e2e.rl_plugins:non_digit_share",
          "--algorithm.entropy-coef", "0.01")
ACCOUNTED = ("--schedule", "fully_async", "--sync.transport", "disk", "--buffer.max-staleness", "0",
             "--rollout.admission", "fill", "--buffer.capacity-factor", "3", "--buffer.unused", "drop",
             "--buffer.path", "tests.e2e.rl_plugins:AccountingBuffer", "--checkpoint.export-hf", "false")
COMPARED = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/advantage_abs_mean")


def train_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def assert_same_run(resumed: Path, through: Path, steps: int, source: Path,
                    compared: tuple[str, ...] = COMPARED) -> None:
    """The same metrics at every step and the same final weights within 1e-6, weights that training moved from
    `source`'s by more than that (so the comparison can fail)."""
    a, b = train_rows(resumed), train_rows(through)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        for key in compared:
            assert a[step][key] == pytest.approx(b[step][key], abs=1e-6), (step, key)
    pa, pb = load_file(str(resumed / "hf" / "model.safetensors")), load_file(str(through / "hf" / "model.safetensors"))
    assert pa.keys() == pb.keys()
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], atol=1e-6, rtol=0, err_msg=name)
    start = load_file(str(source / "model.safetensors"))
    assert max(float(np.abs(pb[name] - start[name]).max()) for name in pb if name in start) > 1e-5


# PPO: the critic, its optimizer and lr schedule resume too (a reward the critic has returns to fit).
PPO = ("--algorithm.advantage-estimator", "ppo", "--critic.lr", "3e-3",
       "--reward.type", "custom", "--reward.path", "tests.e2e.rl_plugins:non_digit_share")
PPO_COMPARED = (*COMPARED, "train/value_loss", "train/value_mean", "train/value_grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, compared", [(SIGNAL, COMPARED), (PPO, PPO_COMPARED)], ids=["grpo", "ppo"])
def test_sync_resume_matches_an_uninterrupted_run(ray_session, tiny_model_dir, addition_data_dir, tmp_path,  # noqa: F811
                                                  algorithm, compared):
    through = rl_config(tmp_path / "through", tiny_model_dir, addition_data_dir, *SEEDED, *algorithm,
                        "--rollout.num-rollouts", "3", "--checkpoint.interval", "1", "--checkpoint.keep-last", "2")
    run_schedule(through)
    ckpts = Path(through.run_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_3"]  # keep_last
    assert read_latest(Path(through.run_dir)).name == "step_3"
    manifest = read_manifest(ckpts / "step_3")
    assert manifest["version"] == 3 and manifest["config"]["rollout"]["num_rollouts"] == 3
    assert [r["step"] for r in read_metrics(Path(through.run_dir)) if "time/checkpoint_s" in r] == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(Path(through.run_dir) / "hf")  # the final model loads

    first = rl_config(tmp_path / "resumed", tiny_model_dir, addition_data_dir, *SEEDED, *algorithm,
                      "--rollout.num-rollouts", "1")
    run_schedule(first)
    resumed = first.model_copy(update={
        "rollout": first.rollout.model_copy(update={"num_rollouts": 3}),
        "checkpoint": first.checkpoint.model_copy(update={"load": first.run_dir}),
    })
    summary = run_schedule(resumed)
    assert summary["train/steps"] == 3
    assert_same_run(Path(resumed.run_dir), Path(through.run_dir), steps=3, source=tiny_model_dir, compared=compared)


def test_resume_refuses_a_changed_field_then_continues(ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from verst.run.checkpointer import prepare_resume

    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", "1")
    run_schedule(cfg)
    AutoModelForCausalLM.from_pretrained(Path(cfg.run_dir) / "hf")  # the final model loads
    assert not (Path(cfg.run_dir) / "hf" / "chat_template.jinja").exists()  # trained on raw prompts
    changed = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", "2",
                        "--trainer.lr", "3e-4", "--checkpoint.load", cfg.run_dir, "--eval.max-prompts", "4")
    with pytest.raises(CheckpointError, match=r"trainer.lr: checkpoint 0.0001, now 0.0003"):
        prepare_resume(changed)
    manifest = json.loads((Path(cfg.run_dir) / "checkpoints" / "step_1" / "manifest.json").read_text())
    assert manifest["eval_history"][0][0] == 0

    resumed = changed.model_copy(update={"trainer": cfg.trainer})  # only safe fields differ now
    summary = run_schedule(resumed)
    assert summary["train/steps"] == 2
    segments = summary["segments"]  # the totals cover both segments
    assert [(s["from_step"], s["to_step"], s["end"]) for s in segments] == [(0, 1, "finished"), (1, 2, "finished")]
    assert summary["time/total_s"] == pytest.approx(sum(s["seconds"] for s in segments))
    assert summary["time/total_s"] > segments[1]["seconds"] > 0
    records = read_metrics(Path(cfg.run_dir))
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]  # the same metrics.jsonl, continued
    assert [r["eval/weight_version"] for r in records if "eval/accuracy" in r] == [0, 1, 2]
    assert read_latest(Path(cfg.run_dir)).name == "step_2"


# ---- a driver killed with SIGKILL, then `verst train --resume` -------------------------------------
def verst(args: list[str], tag: str, ray_tmp: str, env: dict | None = None,
          module: str = "verst.cli.main") -> subprocess.Popen:
    """`verst ARGS` (`python -m module ARGS`) in its own session; every process it starts inherits `tag` (to
    find them after a kill)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp, "VERST_TEST_TAG": tag, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", module, *args], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every process of this user whose environment carries `tag` (Ray's daemons and workers,
    engines); returns their PIDs."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"VERST_TEST_TAG={tag}".encode() in environ.split(b"\0"):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


def kill_after_a_checkpoint_then_resume(args: list[str], run_dir: Path, steps: int, env: dict | None = None) -> int:
    """`verst train ARGS` killed (SIGKILL of its process group, then of every process it started) once a
    checkpoint past step 0 is there, then `verst train --resume RUN_DIR` to the end; the step resumed at."""
    tag, ray_tmp = uuid.uuid4().hex, tempfile.mkdtemp(prefix="vr", dir="/tmp")
    try:
        proc = verst(["train", *args], tag, ray_tmp, env)
        deadline = time.monotonic() + 240
        while read_latest(run_dir) is None or read_latest(run_dir).name == "step_0":
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kill_tagged(tag)
        killed_at = read_manifest(read_latest(run_dir))["step"]
        assert killed_at < steps, "the run finished before it was killed; nothing was resumed"

        resumed = verst(["train", "--resume", str(run_dir)], tag, ray_tmp, env)
        out, _ = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, out
        assert f"resumed from {run_dir / 'checkpoints' / f'step_{killed_at}'}" in out
        return killed_at
    finally:
        kill_tagged(tag)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(ray_session, tiny_model_dir, addition_data_dir,  # noqa: F811
                                                          tmp_path):
    steps = 3
    args = rl_args(tmp_path / "killed", tiny_model_dir, addition_data_dir, *SEEDED, *SIGNAL, "--rollout.num-rollouts",
                   str(steps), "--checkpoint.interval", "1")
    run_dir = tmp_path / "killed" / "run"
    kill_after_a_checkpoint_then_resume(args, run_dir, steps)
    through = rl_config(tmp_path / "through", tiny_model_dir, addition_data_dir, *SEEDED, *SIGNAL,
                        "--rollout.num-rollouts", str(steps))
    run_schedule(through)
    assert_same_run(run_dir, Path(through.run_dir), steps=steps, source=tiny_model_dir)


@pytest.mark.slow
def test_fully_async_accounting_across_a_sigkill(ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    steps, records = 4, tmp_path / "records"
    records.mkdir()
    args = rl_args(tmp_path, tiny_model_dir, addition_data_dir, *ACCOUNTED, "--rollout.num-rollouts", str(steps),
                   "--checkpoint.interval", "1")
    resumed_at = kill_after_a_checkpoint_then_resume(args, tmp_path / "run", steps,
                                                     env={"VERST_TEST_RECORD_DIR": str(records)})
    check_accounting(records / "accounting.jsonl", tmp_path / "run", resumed_at, steps)


def test_fully_async_accounting_across_a_resume(ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    """Resumed from a checkpoint taken while the worker generated: every prompt is trained at most once or
    recorded as dropped, and the cumulative counts in the metrics equal the recorded events."""
    first = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *ACCOUNTED, "--rollout.num-rollouts", "2",
                      "--checkpoint.interval", "1")
    run_schedule(first)
    step_1 = Path(first.run_dir) / "checkpoints" / "step_1"
    resumed = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *ACCOUNTED, "--rollout.num-rollouts", "3",
                        "--checkpoint.load", str(step_1))
    run_schedule(resumed)

    check_accounting(ray_session / "accounting.jsonl", Path(resumed.run_dir), resumed_at=1, steps=3)
    assert "returned_in_flight_groups" in read_manifest(step_1)["rollout"]


def check_accounting(events_file: Path, run_dir: Path, resumed_at: int, steps: int) -> None:
    """The first run's events up to its checkpoint of step `resumed_at` and all the resumed run's: every
    prompt trained at most once or dropped, never both, and the metrics' cumulative counts equal them."""
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    first_pid = events[0]["pid"]
    # The checkpoint of step k records the buffer after the take of step k, made at version k - 1.
    cut = next(i for i, e in enumerate(events)
               if e["pid"] == first_pid and e["event"] == "checkpoint" and e["version"] == resumed_at - 1)
    kept = events[:cut] + [e for e in events[cut:] if e["pid"] != first_pid]  # what followed the checkpoint goes
    trained = [e["row"] for e in kept if e["event"] == "trained"]
    dropped = [e["row"] for e in kept if e["event"] in ("stale", "aborted", "filtered")]
    assert len(trained) == steps * 4  # four groups a step
    assert len(set(trained)) == len(trained) and len(set(dropped)) == len(dropped)
    assert not set(trained) & set(dropped)
    assert any(e["event"] == "stale" for e in kept)  # max_staleness 0 filling the buffer drops some
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, steps + 1))
    last = [r for r in records if "buffer/dropped_stale_total" in r][-1]
    assert last["buffer/dropped_stale_total"] == sum(e["event"] == "stale" for e in kept)
    assert last["buffer/dropped_aborted_total"] == sum(e["event"] == "aborted" for e in kept)


# ---- resumed on another trainer mesh ------------------------------------------------------------------
MESHES = {"one rank": ("--cluster.trainer-ranks", "1"),
          "tp 2": ("--cluster.trainer-ranks", "2", "--trainer.tensor-parallel-size", "2"),
          "dp 2": ("--cluster.trainer-ranks", "2")}
# An RL learning rate. Each AdamW step moves a weight by about lr (its update is near lr x sign(m)), ten times
# the 1e-6 tolerance, so a step lost or an optimizer state not resharded shows; the two meshes' float32 sums
# differ in the last bits (~1e-7 relative), which moves an update by lr x that, far below the tolerance. Where a
# gradient is itself near AdamW's eps (the entropy bonus reaches every vocabulary row of the head, most of them
# barely), those bits move its update by a share of lr: a few such weights may differ by more than 1e-6, none by lr.
RESHARD_LR = "1e-5"
NEAR_EPS_SHARE = 1e-3  # of a tensor's weights, at most
# The batch's logprobs: the trainer's entropy over it, and its distance from the engine's logprobs of the same tokens.
RESHARD_COMPARED = ("rollout/reward_mean", "train/advantage_abs_mean", "train/loss", "train/pg_loss", "train/entropy",
                    "train/rollout_logprob_abs_diff", "train/rollout_kl", "train/mismatch_ratio_mean")


def dcp_weights(trainer_dir: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """The model weights of a checkpoint's DCP shards, read without a process group."""
    dcp_to_torch_save(trainer_dir / "dcp", tmp_path / "state.pt")
    return {name: t.numpy() for name, t in torch.load(tmp_path / "state.pt", weights_only=False)["model"].items()}


@pytest.mark.parametrize("saved_on, resumed_on", [
    ("tp 2", "one rank"),
    pytest.param("one rank", "tp 2", marks=pytest.mark.slow),
    pytest.param("dp 2", "one rank", marks=pytest.mark.slow),
    pytest.param("one rank", "dp 2", marks=pytest.mark.slow),
    pytest.param("dp 2", "tp 2", marks=pytest.mark.slow),  # the same ranks on another mesh
])
def test_a_run_resumes_on_another_trainer_mesh(ray_session, tiny_model_dir, addition_data_dir, tmp_path, caplog,  # noqa: F811
                                               saved_on, resumed_on):
    """Run A, on the mesh `saved_on`, saves step 1 and trains step 2; run B resumes A's step 1 on `resumed_on`
    and trains step 2: the same batch (the engines served the same weights), the step's loss and logprob
    metrics within 1e-6, its gradient norm within 1e-5 relative, and the weights after it within 1e-6 but for at
    most 0.1% of a tensor's (those whose gradients are near AdamW's eps), which stay within lr."""
    common = (*SEEDED, "--trainer.lr", RESHARD_LR, "--rollout.num-rollouts", "2", "--checkpoint.keep-last", "0",
              *SIGNAL)
    saved = rl_config(tmp_path / "saved", tiny_model_dir, addition_data_dir, *common, *MESHES[saved_on],
                      "--checkpoint.interval", "1")
    run_schedule(saved)
    step_1 = Path(saved.run_dir) / "checkpoints" / "step_1"
    resumed = rl_config(tmp_path / "resumed", tiny_model_dir, addition_data_dir, *common, *MESHES[resumed_on],
                        "--checkpoint.load", str(step_1))
    with caplog.at_level("WARNING", logger="verst.run.checkpointer"):
        summary = run_schedule(resumed)
    assert summary["train/steps"] == 2
    assert "on another trainer mesh" in caplog.text, caplog.text

    a, b = train_rows(Path(saved.run_dir)), train_rows(Path(resumed.run_dir))
    assert sorted(b) == [2]  # the resumed run's own rows: only the step it took
    for key in RESHARD_COMPARED:  # relative for the entropy (~5.5, where float32 values lie 4.8e-7 apart)
        assert b[2][key] == pytest.approx(a[2][key], rel=1e-6, abs=1e-6), key
    # the norm of ~0.5M gradients summed in float32 in each mesh's order (tp: local shards, then an all-reduce)
    assert b[2]["train/grad_norm"] == pytest.approx(a[2]["train/grad_norm"], rel=1e-5)
    assert read_samples(Path(resumed.run_dir))[2] == read_samples(Path(saved.run_dir))[2]  # the same batch

    after_a = load_file(str(Path(saved.run_dir) / "hf" / "model.safetensors"))
    after_b = load_file(str(Path(resumed.run_dir) / "hf" / "model.safetensors"))
    before = dcp_weights(step_1 / "trainer", tmp_path)
    assert after_a.keys() == after_b.keys() and after_a.keys() <= before.keys()
    moved = max(float(np.abs(after_a[name] - before[name]).max()) for name in after_a)
    assert moved > 5e-6, f"step 2 moved no weight by more than {moved}: the comparison would prove nothing"
    for name in after_a:
        diff = np.abs(after_b[name] - after_a[name])
        assert diff.max() < float(RESHARD_LR), (name, float(diff.max()))
        assert (diff > 1e-6).mean() <= NEAR_EPS_SHARE, (name, int((diff > 1e-6).sum()), diff.size)
