"""The checkpoint directory: atomic commit with a `latest` pointer, pruning, what `checkpoint.load`
accepts, the resume rules for a changed config, and metrics kept up to the checkpoint."""

from __future__ import annotations

import errno
import json
import os

import pytest

from verst.config import VerstConfig, load_config
from verst.monitor import checkpoint_dirs as layout


def fake_step(run_dir, step, keep_last=0):
    tmp = layout.new_tmp_dir(run_dir, step)
    (tmp / layout.TRAINER_DIR).mkdir()
    (tmp / layout.TRAINER_DIR / "COMPLETE").write_text("x")
    return layout.commit(tmp, {"step": step, "version": step, "config": {}}, keep_last)


def test_commit_moves_latest_and_prunes(tmp_path):
    for step in (1, 2, 3):
        fake_step(tmp_path, step, keep_last=2)
    assert layout.read_latest(tmp_path).name == "step_3"
    assert sorted(p.name for p in layout.checkpoints_dir(tmp_path).glob("step_*")) == ["step_2", "step_3"]
    assert layout.resolve(tmp_path) == layout.checkpoints_dir(tmp_path) / "step_3"
    assert layout.read_manifest(layout.resolve(tmp_path))["version"] == 3


def step_names(run_dir):
    return sorted((p.name for p in layout.checkpoints_dir(run_dir).glob("step_*")), key=lambda n: int(n[5:]))


def test_a_run_keeps_its_newest_three_checkpoints_by_default(tmp_path):
    keep_last = VerstConfig().checkpoint.keep_last
    for step in range(1, 6):
        fake_step(tmp_path, step, keep_last)
    assert step_names(tmp_path) == ["step_3", "step_4", "step_5"]
    assert layout.resolve(tmp_path).name == "step_5"


def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path):
    """A run resumed from an older step (checkpoint.load = .../step_10) saves below the newest step numbers:
    its own checkpoint, the oldest by number, stays, as a restart or --resume reads it next."""
    keep_last = VerstConfig().checkpoint.keep_last
    for step in (10, 20, 30, 40):
        fake_step(tmp_path, step, keep_last)
    assert step_names(tmp_path) == ["step_20", "step_30", "step_40"]
    fake_step(tmp_path, 15, keep_last)
    assert step_names(tmp_path) == ["step_15", "step_20", "step_30", "step_40"]
    assert layout.resolve(tmp_path) == layout.checkpoints_dir(tmp_path) / "step_15"


def test_keep_last_0_keeps_every_checkpoint(tmp_path):
    for step in range(1, 6):
        fake_step(tmp_path, step, keep_last=0)
    assert step_names(tmp_path) == [f"step_{step}" for step in range(1, 6)]


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    fake_step(tmp_path, 1)
    tmp = layout.new_tmp_dir(tmp_path, 2)  # a save that never finished: no manifest, no rename
    (tmp / "half-written").write_text("x")
    (tmp_path / "config.yaml").write_text("{}")
    assert layout.resolve(tmp_path).name == "step_1"
    layout.remove_tmp_dirs(tmp_path)
    assert not tmp.exists()


def test_a_full_disk_names_the_checkpoint_and_the_error_and_keeps_the_previous_one(tmp_path, monkeypatch):
    fake_step(tmp_path, 1)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(layout.os, "fsync", full)
    with pytest.raises(layout.CheckpointError) as caught:
        fake_step(tmp_path, 2)
    monkeypatch.undo()
    step_1, step_2 = (layout.checkpoints_dir(tmp_path) / f"step_{step}" for step in (1, 2))
    assert str(caught.value) == (f"checkpoint {step_2} not saved: OSError: [Errno 28] No space left on device; "
                                 f"{step_1} is still the latest checkpoint")
    assert not step_2.exists() and list(layout.checkpoints_dir(tmp_path).glob(f"{layout.TMP_PREFIX}*")) == []
    assert layout.resolve(tmp_path) == step_1 and layout.read_manifest(step_1)["step"] == 1


def test_load_refuses_what_is_not_a_complete_checkpoint(tmp_path):
    with pytest.raises(layout.CheckpointError, match="does not exist"):
        layout.resolve(tmp_path / "nothing")
    (tmp_path / "config.yaml").write_text("{}")
    with pytest.raises(layout.CheckpointError, match="no complete checkpoint"):
        layout.resolve(tmp_path)
    step = fake_step(tmp_path, 1)
    (step / layout.TRAINER_DIR / "COMPLETE").unlink()
    with pytest.raises(layout.CheckpointError, match="missing trainer/COMPLETE"):
        layout.resolve(step)


def test_only_safe_fields_may_change():
    saved = load_config(None, ["--trainer.lr", "1e-4", "--model.path", "m"]).model_dump(mode="json")
    safe = load_config(None, ["--trainer.lr", "1e-4", "--model.path", "m", "--eval.interval", "3",
                              "--rollout.num-rollouts", "99", "--logging.tensorboard", "false", "--name", "x"])
    assert layout.changed_fields(saved, safe) == []
    unsafe = load_config(None, ["--trainer.lr", "2e-4", "--model.path", "m", "--rollout.batch-size", "3"])
    assert layout.changed_fields(saved, unsafe) == [("rollout.batch_size", saved["rollout"]["batch_size"], 3),
                                                    ("trainer.lr", 1e-4, 2e-4)]


def test_the_trainer_mesh_may_change_and_is_named(tmp_path):
    """cluster.trainer_ranks and trainer.tensor_parallel_size may change (the trainer reshards); a field
    outside the mesh changed with them is still refused, naming it with both values."""
    base = ["--model.path", "m", "--trainer.global-batch-size", "8"]
    saved = load_config(None, [*base, "--cluster.trainer-ranks", "4", "--trainer.tensor-parallel-size", "2"])
    one_rank = load_config(None, base)
    dp_only = load_config(None, [*base, "--cluster.trainer-ranks", "2"])
    assert layout.changed_fields(saved.model_dump(mode="json"), one_rank) == []
    assert layout.mesh_change(saved.model_dump(mode="json"), one_rank) == "dp 2 x tp 2 -> dp 1 x tp 1"
    assert layout.mesh_change(one_rank.model_dump(mode="json"), dp_only) == "dp 1 x tp 1 -> dp 2 x tp 1"
    assert layout.mesh_change(dp_only.model_dump(mode="json"), dp_only) is None
    context = load_config(None, [*base, "--cluster.trainer-ranks", "4", "--trainer.context-parallel-size", "2"])
    assert layout.changed_fields(context.model_dump(mode="json"), one_rank) == []
    assert layout.mesh_change(context.model_dump(mode="json"), one_rank) == "dp 2 x tp 1 x cp 2 -> dp 1 x tp 1"
    sequence = load_config(None, [*base, "--cluster.trainer-ranks", "4", "--trainer.tensor-parallel-size", "2",
                                  "--trainer.sequence-parallel", "true"])
    assert layout.changed_fields(sequence.model_dump(mode="json"), one_rank) == []  # activations only: no reshard
    assert layout.changed_fields(sequence.model_dump(mode="json"), saved) == []
    assert layout.mesh_change(sequence.model_dump(mode="json"), saved) is None

    step = fake_step(tmp_path, 1)
    manifest = json.loads((step / layout.MANIFEST_FILE).read_text())
    manifest["config"] = saved.model_dump(mode="json")
    (step / layout.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert layout.check_resume_config(step, one_rank)["step"] == 1
    changed = load_config(None, [*base, "--cluster.num-engines", "2"])
    with pytest.raises(layout.CheckpointError, match=r"cluster.num_engines: checkpoint 1, now 2") as refused:
        layout.check_resume_config(step, changed)
    assert "trainer_ranks:" not in str(refused.value)


def test_trim_metrics_keeps_rows_up_to_the_checkpoint(tmp_path):
    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "train/loss": 1.0}, {"step": 2, "train/loss": 0.9},
            {"step": 2, "eval/accuracy": 0.2}, {"step": 3, "train/loss": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    layout.trim_metrics(tmp_path, 2, drop_eval_at_step=True)
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:3]
