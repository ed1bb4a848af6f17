"""Weight sync from a sharded trainer, through every weight transport: two trainer ranks at tensor parallel 2,
context parallel 2 (the tiny Qwen3) or expert parallel 2 (the tiny Qwen3-MoE) push their weights after each step
(full tensors gathered bucket by bucket from the shards), and the weight check scores the engine's logprobs
against the trainer's after the first push."""

from __future__ import annotations

import pytest

from tests.e2e.test_rl_schedules import (
    check_run,
    ray_session,  # noqa: F401  (the module's Ray session)
    rl_config,
    run_schedule,
)
from verst.models.factory import init_model

LAYOUTS = {"tp 2": ("--trainer.tensor-parallel-size", "2", "--model.impl", "native"),
           "cp 2": ("--trainer.context-parallel-size", "2", "--model.impl", "native"),
           "ep 2": ("--trainer.expert-parallel-size", "2", "--algorithm.routing-replay", "replay")}
CASES = [pytest.param(layout, transport, id=f"{layout}-{transport}",
                      marks=() if (layout, transport) == ("tp 2", "distributed") else pytest.mark.slow)
         for layout in LAYOUTS for transport in ("distributed", "tensor", "disk")]


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return init_model("qwen3-moe", "tiny", tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", seed=3)


@pytest.mark.parametrize(("layout", "transport"), CASES)
def test_a_sharded_trainer_pushes_its_weights_through_each_transport(request, ray_session,  # noqa: F811
                                                                       addition_data_dir, tmp_path, layout, transport):
    model_dir = request.getfixturevalue("moe_model_dir" if layout == "ep 2" else "tiny_model_dir")
    cfg = rl_config(tmp_path, model_dir, addition_data_dir, "--schedule", "sync",
                    "--sync.transport", transport, "--sync.check-weights", "true",
                    "--cluster.trainer-ranks", "2", *LAYOUTS[layout])
    records = check_run(cfg, run_schedule(cfg), steps=2)
    checked = [r for r in records if "sync/check_max_abs_diff" in r]
    assert len(checked) == 1, [sorted(r) for r in records]  # once, after the first push
    assert checked[0]["sync/check_max_abs_diff"] < 1e-4
