"""bench/step_overhead.py's breakdown of a step: engine and train compute taken out of the wall time between two
steps' log records (the step's own time and what the driver does after it), in turn on the sync schedule and
overlapping on the others; the warm-up steps left out."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "step_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_step_overhead", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(step, logged_at, step_s, idle, rollout, train, sync):
    return {"step": step, "time": logged_at, "perf/step_time_s": step_s, "perf/engine_idle_fraction": idle,
            "time/rollout_s": rollout, "time/train_s": train, "sync/seconds": sync}


def test_sync_steps_split_into_engine_train_sync_and_the_rest(bench):
    records = [row(1, 100.0, 9.0, 0.0, 9.0, 0.0, 0.0),  # a warm-up step, left out
               row(2, 100.210, 0.200, 0.75, 0.070, 0.090, 0.010),  # 10 ms of the driver's after the step's timing
               {"step": 2, "time": 100.3, "eval/accuracy": 0.5},
               row(3, 100.440, 0.220, 0.75, 0.080, 0.090, 0.012)]
    out = bench.breakdown("sync", records, warmup=1)
    assert out["steps"] == 2
    assert out["period"] == pytest.approx((0.210 + 0.230) / 2)
    assert out["engine"] == pytest.approx((0.0525 + 0.0575) / 2)  # the engines' busy share of the period
    assert out["rollout_glue"] == pytest.approx((0.0175 + 0.0225) / 2)
    assert out["other"] == pytest.approx((0.040 + 0.048) / 2)
    assert out["overhead"] == pytest.approx((0.0675 + 0.0825) / 2)


def test_overlapping_schedules_take_out_the_longer_of_engine_and_train(bench):
    records = [row(1, 10.0, 0.2, 0.0, 0.0, 0.1, 0.0), row(2, 10.2, 0.190, 0.25, 0.0, 0.120, 0.010),
               row(3, 10.4, 0.190, 0.50, 0.0, 0.150, 0.010)]
    out = bench.breakdown("fully_async", records, warmup=1)
    assert out["overhead"] == pytest.approx(((0.200 - 0.150) + (0.200 - 0.150)) / 2)
    assert "rollout_glue" not in out


def test_a_run_with_no_step_after_the_warm_up_is_an_error(bench):
    with pytest.raises(RuntimeError, match="no step after the warm-up of 5"):
        bench.breakdown("sync", [row(3, 1.0, 0.2, 0.5, 0.1, 0.1, 0.0), row(4, 1.2, 0.2, 0.5, 0.1, 0.1, 0.0)],
                        warmup=5)
