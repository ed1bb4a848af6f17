"""Multi-LoRA end to end on the tiny model: two adapters on two tasks (addition, reversal) in one run (fully
async and sync) on shared engines, each with its own data, reward and optimizer; metrics under lora/<name>/,
each sync the adapter's own bytes, every adapter in the export; under `slow`, a resume that goes on with
every adapter, and both adapters improving (addition and chain addition on an SFT warm start)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.e2e.test_rl_schedules import ray_session, rl_args, run_schedule  # noqa: F401  (the module's Ray session)
from tests.metrics_doc import undocumented
from verst.config import VerstConfig, load_config
from verst.monitor import read_metrics

NAMES = ("add", "rev")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reversal_data_dir(tmp_path_factory):
    from verst.data import make_splits, write_jsonl

    out = tmp_path_factory.mktemp("data") / "reversal"
    train, test = make_splits("reversal", n_train=500, n_test=50, seed=0)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(test, out / "test.jsonl")
    return out


def recipe(path: Path, rev_data: Path) -> Path:
    """Two adapters: add on the run's data (addition, numeric_match), rev on reversal with exact_match, a
    smaller rank on fewer modules and its own lr."""
    path.write_text(f"""
[lora]
enabled = true
rank = 4
target_modules = ["q_proj", "v_proj", "up_proj"]

[[lora.adapters]]
name = "add"

[[lora.adapters]]
name = "rev"
rank = 2
target_modules = ["q_proj"]
lr = 2e-2
data = {{ train_path = "{rev_data / 'train.jsonl'}", test_path = "{rev_data / 'test.jsonl'}", apply_chat_template = false }}
reward = {{ type = "exact_match" }}
""")
    return path


def multi_config(tmp_path, model_dir, data_dir, rev_data, *overrides):
    args = rl_args(tmp_path, model_dir, data_dir, "--schedule", "fully_async", "--trainer.lr", "1e-2",
                   "--algorithm.entropy-coef", "0.1", "--sync.check-weights", "true", *overrides)
    return load_config(recipe(tmp_path / "multi.toml", rev_data), args)


def check_adapters(run_dir: Path, steps_each: int) -> list[dict]:
    """Both adapters took `steps_each` steps in turn, each pushed alone under its name (its own bytes, the
    weight check within 1e-4), with documented metrics and an export each; returns the metric records."""
    records = read_metrics(run_dir)
    assert undocumented(records) == []  # every logged key has its line in docs/metrics.md
    for name in NAMES:
        steps = [r for r in records if f"lora/{name}/train/loss" in r]
        assert [r[f"lora/{name}/train/steps"] for r in steps] == list(range(1, steps_each + 1))
        assert all(math.isfinite(r[f"lora/{name}/train/loss"]) for r in steps)
        # each push is that adapter alone, under its name: its bytes are its export's (float32)
        export = load_file(run_dir / "hf" / name / "adapter_model.safetensors")
        size = sum(t.numel() * t.element_size() for t in export.values())
        assert all(r[f"lora/{name}/sync/bytes"] == size for r in steps), ([r[f"lora/{name}/sync/bytes"] for r in steps], size)
        # each adapter's first step trains on samples from before its own first update (rev's: of version 0
        # fully async, of version 1 in the sync schedule, after add's push): the engines sampled with the
        # adapter the trainer holds, whatever the other adapter's update
        assert steps[0][f"lora/{name}/rollout/weight_version_mean"] <= steps[0]["step"] - 1
        assert steps[0][f"lora/{name}/train/rollout_logprob_abs_diff"] < 1e-4
        assert json.loads((run_dir / "hf" / name / "adapter_config.json").read_text())["r"] == (4 if name == "add" else 2)
    checks = [r[k] for r in records for k in r if k.endswith("sync/check_max_abs_diff")]
    assert checks and max(checks) < 1e-4, checks
    trained = [r["step"] for r in records if "lora/add/train/loss" in r or "lora/rev/train/loss" in r]
    assert trained == list(range(1, 2 * steps_each + 1))  # one adapter per run version, in turn
    assert [r for r in records if "lora/add/train/loss" in r][0]["step"] == 1
    return records


@pytest.mark.parametrize("schedule", ["fully_async", "sync"])
def test_two_adapters_train_in_one_run(schedule, ray_session, tiny_model_dir, addition_data_dir,  # noqa: F811
                                       reversal_data_dir, tmp_path):
    cfg = multi_config(tmp_path, tiny_model_dir, addition_data_dir, reversal_data_dir, "--schedule", schedule,
                       "--rollout.num-rollouts", "1")
    summary = run_schedule(cfg)
    assert summary["train/steps"] == 2 and all(summary[f"lora/{n}/train/steps"] == 1 for n in NAMES)
    assert all(f"lora/{n}/eval/accuracy_after" in summary for n in NAMES)
    records = check_adapters(Path(cfg.run_dir), 1)
    for name in NAMES:
        assert [r["step"] for r in records if f"lora/{name}/eval/accuracy" in r] == [0, 2]
        assert f"lora/{name}/rollout/reward_mean" in [r for r in records if f"lora/{name}/train/loss" in r][0]


@pytest.mark.slow
def test_a_multi_lora_run_resumes_every_adapter(ray_session, tiny_model_dir, addition_data_dir,  # noqa: F811
                                                reversal_data_dir, tmp_path):
    first = multi_config(tmp_path, tiny_model_dir, addition_data_dir, reversal_data_dir, "--rollout.num-rollouts", "1",
                         "--checkpoint.interval", "1")
    summary = run_schedule(first)
    assert summary["train/steps"] == 2 and all(summary[f"lora/{n}/train/steps"] == 1 for n in NAMES)
    resumed = multi_config(tmp_path, tiny_model_dir, addition_data_dir, reversal_data_dir, "--rollout.num-rollouts",
                           "2", "--checkpoint.load", first.run_dir)
    summary = run_schedule(resumed)
    assert summary["train/steps"] == 4 and all(summary[f"lora/{n}/train/steps"] == 2 for n in NAMES)
    run_dir = Path(first.run_dir)
    records = check_adapters(run_dir, 2)
    for name in NAMES:  # at the start, the first run's end, the resumed end
        assert [r["step"] for r in records if f"lora/{name}/eval/accuracy" in r] == [0, 2, 4]
    assert {p.name for p in (run_dir / "checkpoints" / "step_4").iterdir()} >= {"rollout_add.pkl", "rollout_rev.pkl"}
    manifest = json.loads((run_dir / "checkpoints" / "step_4" / "manifest.json").read_text())
    assert {name: entry["steps"] for name, entry in manifest["adapters"].items()} == {"add": 2, "rev": 2}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_both_adapters_raise_their_held_out_accuracy(ray_session, tiny_model_dir, tmp_path):  # noqa: F811
    """recipes/grpo_multi_lora.toml as docs/lora.md measures it, on the `make demo` SFT warm start made here
    (the teacher's addition data, recipes/sft_addition.toml): `add` (addition) and `chain` (chain addition)
    both raise their held-out accuracy in one run."""
    from examples.demo import SFT_DATA_NAME, TEACHER_CARRY_ERROR_RATE
    from tests.e2e.test_sft import sft_args
    from verst.cli.main import main
    from verst.data import make_splits, write_jsonl
    from verst.data.teachers import forgets_carry

    data, trains = {}, {}
    for task, n_train in (("addition", 4000), ("chain_addition", 5000)):  # as `make demo`, `verst data make`
        data[task] = tmp_path / task
        trains[task], test = make_splits(task, n_train=n_train, n_test=200, seed=0)
        write_jsonl(trains[task], data[task] / "train.jsonl")
        write_jsonl(test, data[task] / "test.jsonl")
    write_jsonl(forgets_carry(trains["addition"], TEACHER_CARRY_ERROR_RATE, seed=0), data["addition"] / SFT_DATA_NAME)
    sft = tmp_path / "sft"
    assert main(sft_args(tiny_model_dir, data["addition"], sft, "--data.train-path",
                         str(data["addition"] / SFT_DATA_NAME), recipe=str(REPO / "recipes" / "sft_addition.toml"))) == 0
    args = ["--model.path", str(sft / "hf"), "--run-dir", str(tmp_path / "run"),
            "--data.train-path", str(data["addition"] / "train.jsonl"),
            "--data.test-path", str(data["addition"] / "test.jsonl"),
            "--eval.interval", "0", "--logging.progress", "false", "--logging.tensorboard", "false"]
    tree = load_config(REPO / "recipes" / "grpo_multi_lora.toml", args).model_dump()
    chain = next(a for a in tree["lora"]["adapters"] if a["name"] == "chain")
    chain["data"] |= {"train_path": str(data["chain_addition"] / "train.jsonl"),
                      "test_path": str(data["chain_addition"] / "test.jsonl")}
    summary = run_schedule(VerstConfig.model_validate(tree))
    for name in ("add", "chain"):
        before, after = summary[f"lora/{name}/eval/accuracy_before"], summary[f"lora/{name}/eval/accuracy_after"]
        assert after > before, (name, before, after)

