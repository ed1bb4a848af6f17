"""Expert parallelism on gloo ranks (float32), tiny Qwen3-MoE (4 experts, top 2): logprobs, entropy, loss,
every parameter's gradient and one step's updated weights (as weight sync gathers them) equal the single-rank
backend's, at ep 2 (also under activation checkpointing) and (slow) ep 4 and dp 2 x ep 2, with the routers'
own choices and with routing replay, and so do a reference model's logprobs; a checkpoint saved at ep 2 resumes
on one rank."""

import pickle

import pytest
import torch

from tests.spawned_ranks import (
    LENGTHS,
    LR,
    TIMEOUT_S,
    assert_resumed_alike,
    assert_tensors_close,
    gradients,
    spawn_ranks,
    synced_weights,
)
from verst.config.schema import ModelConfig, TrainerConfig
from verst.inference_client.ports import free_port
from verst.models.factory import EXPERTS_PER_TOKEN, N_EXPERTS, init_model, model_config
from verst.trainer import ForwardOutputs, MicroBatch, TrainItem

VOCAB = 256
MOE_LAYERS = model_config("qwen3-moe", "tiny").num_hidden_layers


def pg_loss(outputs: ForwardOutputs, batch: MicroBatch, normalizer: float):
    per_token = -batch["advantages"] * outputs.logprobs * batch.loss_mask
    return per_token.sum() / normalizer, {}


def make_items(routed: bool = False) -> list[TrainItem]:
    """Random sequences; with `routed`, random recorded experts (distinct per token), which the routers' own
    choices mostly miss: replay then decides every token's destination rank."""
    g = torch.Generator().manual_seed(5)
    items = []
    for i, (p, r) in enumerate(LENGTHS):
        tokens = torch.randint(0, VOCAB, (p + r,), generator=g)
        experts = torch.rand(p + r - 1, MOE_LAYERS, N_EXPERTS, generator=g).argsort(-1)[..., :EXPERTS_PER_TOKEN]
        items.append(TrainItem(tokens, r, torch.ones(r), {"advantages": torch.randn(r, generator=g)}, i,
                               routed_experts=experts if routed else None))
    return items


def one_step(backend, directory: str, routed: bool) -> dict:
    """Logprobs and entropy (the policy's and the reference's), one train step: its metrics, gradients and
    updated weights."""
    items = make_items(routed)
    logprobs, entropy = backend.logprobs(items, with_entropy=True)
    reference = backend.logprobs(items, reference=True)
    metrics = backend.train_step(items, pg_loss)
    return {"logprobs": logprobs, "entropy": entropy, "reference": reference, "metrics": metrics,
            "grads": gradients(backend), "weights": synced_weights(backend)}


def save_then_step(backend, directory: str, routed: bool) -> dict:
    backend.train_step(make_items(routed), pg_loss)
    backend.save(f"{directory}/checkpoint")
    backend.export_hf(f"{directory}/saved-hf")
    backend.train_step(make_items(routed), pg_loss)
    return {"weights": synced_weights(backend)}


def resume_then_step(backend, directory: str, routed: bool) -> dict:
    backend.load(f"{directory}/checkpoint")
    backend.export_hf(f"{directory}/resumed-hf")
    backend.train_step(make_items(routed), pg_loss)
    return {"weights": synced_weights(backend)}


def _rank(rank: int, world: int, ep: int, port: int, model_path: str, job, directory: str, out: str,
          routing: str, checkpointing: bool) -> None:
    """One trainer rank running `job(backend, directory, routed)`; rank 0 writes what it returned."""
    import torch.distributed as dist

    from verst.trainer import FSDP2Backend
    from verst.trainer.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        config = TrainerConfig(lr=LR, max_tokens_per_micro_batch=40, grad_clip=1e9, expert_parallel_size=ep,
                               gradient_checkpointing=checkpointing)
        backend = FSDP2Backend(ModelConfig(path=model_path), config, device="cpu", routing=routing,
                               ref_model_path=model_path)
        result = job(backend, directory, routing == "replay")
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, ep: int, model_path, tmp_path, job=one_step, routing: str = "measure",
              checkpointing: bool = False) -> dict:
    out = tmp_path / f"{job.__name__}-world{world}-ep{ep}-{routing}-{checkpointing}.pkl"
    args = (world, ep, free_port(), str(model_path), job, str(tmp_path), str(out), routing, checkpointing)
    return spawn_ranks(_rank, world, args, out, TIMEOUT_S)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3-moe", "tiny", tmp_path_factory.mktemp("ep") / "tiny-qwen3-moe", seed=3)


@pytest.fixture(scope="module", params=["measure", "replay"])
def routing(request):
    return request.param


@pytest.fixture(scope="module")
def single(model_path, routing, tmp_path_factory):
    return run_ranks(1, 1, model_path, tmp_path_factory.mktemp("single"), routing=routing)


def assert_same(got: dict, want: dict, atol: float = 1e-5) -> None:
    for name in ("logprobs", "entropy", "reference"):
        for a, b in zip(got[name], want[name], strict=True):
            torch.testing.assert_close(a, b, atol=atol, rtol=0)
    assert got["metrics"].keys() == want["metrics"].keys()
    for key in ("train/loss", "train/routing_mismatch_rate"):
        if key in want["metrics"]:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], abs=atol), key
    assert got["metrics"]["train/grad_norm"] == pytest.approx(want["metrics"]["train/grad_norm"], rel=atol)
    assert_tensors_close(got["grads"], want["grads"], atol)
    assert_tensors_close(got["weights"], want["weights"], atol)


def test_expert_parallel_2_equals_one_rank(model_path, routing, single, tmp_path):
    got = run_ranks(2, 2, model_path, tmp_path, routing=routing)
    assert any(".experts." in name for name in got["weights"])  # full expert tensors, as on one rank
    assert_same(got, single)


def test_expert_parallel_2_recomputes_under_activation_checkpointing(model_path, routing, single, tmp_path):
    """Backward's recomputation of each layer runs its all-to-all again, on every rank in the same order."""
    assert_same(run_ranks(2, 2, model_path, tmp_path, routing=routing, checkpointing=True), single)


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_four_ranks_with_expert_parallel_equal_one_rank(ep, model_path, routing, single, tmp_path):
    """dp 2 x ep 2 (the experts also FSDP-sharded over "dp") and ep 4 (one expert per rank)."""
    assert_same(run_ranks(4, ep, model_path, tmp_path, routing=routing), single)


def test_a_checkpoint_saved_expert_parallel_resumes_on_one_rank(model_path, tmp_path):
    """Saved at ep 2, resumed at one rank (DCP reshards): the same HF export, the next step's weights within 1e-6."""
    saved = run_ranks(2, 2, model_path, tmp_path, save_then_step)
    resumed = run_ranks(1, 1, model_path, tmp_path, resume_then_step)
    assert_resumed_alike(saved, resumed, tmp_path)
