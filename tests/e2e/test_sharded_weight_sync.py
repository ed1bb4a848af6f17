"""Weight sync from a sharded trainer, through every weight transport: two trainer ranks at tensor parallel 2 or
context parallel 2 push their weights after each step (full tensors gathered bucket by bucket from the shards), and
the weight check scores the engine's logprobs against the trainer's after the first push."""

from __future__ import annotations

import pytest

from tests.e2e.test_rl_schedules import (
    check_run,
    ray_session,  # noqa: F401  (the module's Ray session)
    rl_config,
    run_schedule,
)

LAYOUTS = {"tp 2": ("--trainer.tensor-parallel-size", "2"), "cp 2": ("--trainer.context-parallel-size", "2")}
CASES = [pytest.param(layout, transport, id=f"{layout}-{transport}",
                      marks=() if (layout, transport) == ("tp 2", "distributed") else pytest.mark.slow)
         for layout in LAYOUTS for transport in ("distributed", "tensor", "disk")]


@pytest.mark.parametrize(("layout", "transport"), CASES)
def test_a_sharded_trainer_pushes_its_weights_through_each_transport(ray_session, tiny_model_dir,  # noqa: F811
                                                                       addition_data_dir, tmp_path, layout, transport):
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync",
                    "--sync.transport", transport, "--sync.check-weights", "true",
                    "--cluster.trainer-ranks", "2", "--model.impl", "native", *LAYOUTS[layout])
    records = check_run(cfg, run_schedule(cfg), steps=2)
    checked = [r for r in records if "sync/check_max_abs_diff" in r]
    assert len(checked) == 1, [sorted(r) for r in records]  # once, after the first push
    assert checked[0]["sync/check_max_abs_diff"] < 1e-4
