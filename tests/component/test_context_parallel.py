"""Context parallelism on gloo ranks (float32): logprobs, entropy, a reference model's logprobs, loss, gradients and
one step's updated weights equal the single-rank backend's, for cp 2 and dp 2 x cp 2 on verst's native model, with
packed rows of several sequences (positions restarting per document) and with one padded sequence per row, row
widths that 2 x cp does not divide, and under activation checkpointing (the gathers run again in backward); a
checkpoint saved at cp 2 resumes on one rank."""

import pickle

import pytest
import torch

from tests.spawned_ranks import LENGTHS, LR, TIMEOUT_S, assert_resumed_alike, gradients, spawn_ranks, synced_weights
from verst.config.schema import ModelConfig, TrainerConfig
from verst.inference_client.ports import free_port
from verst.models.factory import init_model
from verst.trainer import ForwardOutputs, MicroBatch, TrainItem

VOCAB = 256


def pg_loss(outputs: ForwardOutputs, batch: MicroBatch, normalizer: float):
    per_token = -batch["advantages"] * outputs.logprobs * batch.loss_mask
    entropy = (outputs.entropy.detach() * batch.loss_mask).sum() / batch.loss_mask.sum()  # a micro-batch's mean
    return per_token.sum() / normalizer, {"entropy": entropy}


def make_items() -> list[TrainItem]:
    g = torch.Generator().manual_seed(5)
    return [TrainItem(torch.randint(0, VOCAB, (p + r,), generator=g), r, (torch.rand(r, generator=g) > 0.2).float(),
                      {"advantages": torch.randn(r, generator=g)}, i) for i, (p, r) in enumerate(LENGTHS)]


def one_step(backend, directory: str) -> dict:
    """Logprobs, entropy and the reference's logprobs, one train step: its metrics, gradients and updated weights."""
    items = make_items()
    logprobs, entropy = backend.logprobs(items, with_entropy=True)
    reference = backend.logprobs(items, reference=True)
    metrics = backend.train_step(items, pg_loss, with_entropy=True)
    return {"logprobs": logprobs, "entropy": entropy, "reference": reference, "metrics": metrics,
            "grads": gradients(backend), "weights": synced_weights(backend)}


def save_then_step(backend, directory: str) -> dict:
    """One step, a checkpoint and an HF export, then a second step from it."""
    backend.train_step(make_items(), pg_loss, with_entropy=True)
    backend.save(f"{directory}/checkpoint")
    backend.export_hf(f"{directory}/saved-hf")
    backend.train_step(make_items(), pg_loss, with_entropy=True)
    return {"weights": synced_weights(backend)}


def resume_then_step(backend, directory: str) -> dict:
    """The checkpoint `save_then_step` wrote, loaded on this mesh, exported, and the same second step."""
    backend.load(f"{directory}/checkpoint")
    backend.export_hf(f"{directory}/resumed-hf")
    backend.train_step(make_items(), pg_loss, with_entropy=True)
    return {"weights": synced_weights(backend)}


def _rank(rank: int, world: int, cp: int, port: int, model_path: str, job, directory: str, out: str,
          packing: bool, checkpointing: bool) -> None:
    """One trainer rank running `job(backend, directory)`; rank 0 writes what it returned."""
    import torch.distributed as dist

    from verst.trainer import FSDP2Backend
    from verst.trainer.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        config = TrainerConfig(lr=LR, max_tokens_per_micro_batch=40, grad_clip=1e9, context_parallel_size=cp,
                               gradient_checkpointing=checkpointing)
        backend = FSDP2Backend(ModelConfig(path=model_path), config, device="cpu", packing=packing,
                               ref_model_path=model_path)
        result = job(backend, directory)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, cp: int, model_path, tmp_path, job=one_step, packing: bool = True,
              checkpointing: bool = False) -> dict:
    out = tmp_path / f"{job.__name__}-world{world}-cp{cp}-packed{packing}-checkpointing{checkpointing}.pkl"
    args = (world, cp, free_port(), str(model_path), job, str(tmp_path), str(out), packing, checkpointing)
    return spawn_ranks(_rank, world, args, out, TIMEOUT_S)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("cp") / "tiny-qwen3", seed=3)


@pytest.fixture(scope="module", params=[True, False], ids=["packed", "padded"])
def packing(request):
    return request.param


@pytest.fixture(scope="module")
def single(model_path, packing, tmp_path_factory):
    return run_ranks(1, 1, model_path, tmp_path_factory.mktemp("single"), packing=packing)


def max_diffs(got: dict, want: dict) -> dict[str, float]:
    """The largest absolute difference of each compared quantity."""
    def largest(a, b):
        return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True))

    diffs = {name: largest(got[name], want[name]) for name in ("logprobs", "entropy", "reference")}
    for name in ("grads", "weights"):
        assert got[name].keys() == want[name].keys()
        diffs[name] = largest([got[name][k] for k in want[name]], list(want[name].values()))
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        diffs[key] = abs(got["metrics"][key] - want["metrics"][key])
    return diffs


def assert_same(got: dict, want: dict, atol: float = 1e-5) -> None:
    diffs = max_diffs(got, want)
    print("max abs diffs:", {k: f"{v:.1e}" for k, v in diffs.items()})
    assert all(diff <= atol for diff in diffs.values()), diffs
    assert got["metrics"]["train/grad_norm"] == pytest.approx(want["metrics"]["train/grad_norm"], rel=atol)


def test_context_parallel_2_equals_one_rank(model_path, packing, single, tmp_path):
    assert_same(run_ranks(2, 2, model_path, tmp_path, packing=packing), single)


@pytest.mark.parametrize("packing", [True], ids=["packed"], indirect=True, scope="module")
def test_context_parallel_2_under_activation_checkpointing_equals_one_rank(model_path, packing, single, tmp_path):
    assert_same(run_ranks(2, 2, model_path, tmp_path, packing=packing, checkpointing=True), single)


@pytest.mark.slow
def test_data_2_by_context_2_equals_one_rank(model_path, packing, single, tmp_path):
    assert_same(run_ranks(4, 2, model_path, tmp_path, packing=packing), single)


def test_a_checkpoint_saved_context_parallel_resumes_on_one_rank(model_path, tmp_path):
    """Saved at cp 2, resumed at one rank (DCP reshards): the same HF export, and the next step's weights
    within 1e-6."""
    saved = run_ranks(2, 2, model_path, tmp_path, save_then_step)
    resumed = run_ranks(1, 1, model_path, tmp_path, resume_then_step)
    assert_resumed_alike(saved, resumed, tmp_path)
