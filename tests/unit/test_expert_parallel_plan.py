"""The expert-parallel plan's build-time refusals, by name: a model class without a plan (a dense model) and an
expert count the size does not divide. (Parity on gloo ranks: tests/component/test_expert_parallel.py.)"""

import pytest

from verst.models.factory import N_EXPERTS, init_model
from verst.models.native import load_causal_lm
from verst.trainer.expert_parallel import check_plan


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan")
    return {arch: load_causal_lm(str(init_model(arch, "tiny", root / arch)), "transformers", dtype="float32",
                                 device="cpu") for arch in ("qwen3", "qwen3-moe")}


def test_the_tiny_moe_splits_its_experts_over_sizes_that_divide_them(models):
    for ep in (1, 2, N_EXPERTS):
        check_plan(models["qwen3-moe"], ep)


def test_a_size_that_does_not_divide_the_experts_is_refused_by_count(models):
    with pytest.raises(ValueError, match=f"expert_parallel_size = 3 does not divide the model's num_experts = {N_EXPERTS}"):
        check_plan(models["qwen3-moe"], 3)


def test_a_dense_model_is_refused_by_class(models):
    with pytest.raises(ValueError, match=r"expert_parallel_size = 2 has a plan for \['Qwen3MoeForCausalLM'\], "
                                         r"not Qwen3ForCausalLM"):
        check_plan(models["qwen3"], 2)
