"""Both connectors in a whole RL run on Ray (sync schedule, two steps, the untrained tiny model): the
verifiers rollout fn and the Strands agent fn are imported and run in the rollout manager's actor, the
trainer trains on their batches, and held-out evaluation runs (whole episodes for the agent). The token
accounting of their batches is checked in test_verifiers_connector.py and test_strands_connector.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra: pip install 'verst[verifiers]'")
pytest.importorskip("strands", reason="the strands extra: pip install 'verst[strands]'")

from examples.calculator.make_data import make_data  # noqa: E402
from tests.metrics_doc import undocumented  # noqa: E402
from verst.config import load_config  # noqa: E402
from verst.monitor import read_metrics  # noqa: E402
from verst.schedules import SCHEDULES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--rollout.batch-size", "2", "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "2",
         "--eval.max-prompts", "4", "--eval.interval", "0", "--logging.tensorboard", "false",
         "--logging.progress", "false"]


@pytest.fixture(scope="module")
def ray_session():
    from verst.orchestration import RaySession

    with RaySession(slots=4, log_to_driver=False):
        yield


def run(recipe: str, overrides: list[str]) -> tuple[dict, list[dict]]:
    cfg = load_config(REPO / "recipes" / recipe, [*overrides, *SMALL])
    summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    return summary, read_metrics(Path(cfg.run_dir))


def check_run(summary: dict, records: list[dict], score: str) -> None:
    assert summary["train/steps"] == 2 and (summary["eval/version_before"], summary["eval/version_after"]) == (0, 2)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["rollout/kept_groups"] == 2 and "rollout/tito_mismatch_rate/any" in r for r in train)
    assert [r["eval/weight_version"] for r in records if score in r] == [0, 2]
    assert undocumented(records) == []


@pytest.mark.slow
def test_a_verifiers_environment_trains_as_the_rollout_fn(ray_session, tiny_model_dir, addition_data_dir, tmp_path):
    summary, records = run("grpo_verifiers_addition.toml", [
        "--run-dir", str(tmp_path / "run"), "--model.path", str(tiny_model_dir),
        "--data.train-path", str(addition_data_dir / "train.jsonl"),
        "--data.test-path", str(addition_data_dir / "test.jsonl")])
    check_run(summary, records, "eval/accuracy")


@pytest.mark.slow
def test_a_strands_agent_trains_as_the_agent_fn(ray_session, tiny_model_dir, tmp_path):
    data = make_data(tmp_path / "data", n_train=100, n_test=10)
    summary, records = run("grpo_strands_calculator.toml", [
        "--run-dir", str(tmp_path / "run"), "--model.path", str(tiny_model_dir), "--schedule", "sync",
        "--data.train-path", str(data["train"]), "--data.test-path", str(data["test"]),
        "--rollout.max-response-tokens", "12", "--rollout.dynamic-filter", "null"])
    check_run(summary, records, "eval/success")
