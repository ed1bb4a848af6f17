"""Tensor parallelism on gloo ranks (float32): logprobs, entropy, loss, gradients and one step's updated weights
equal the single-rank backend's, for tp 2 and dp 2 x tp 2 (native model) and tp 2 (transformers' model), each with
sequence parallelism and without, with a tied head and an untied one (the native model's embedding and head split
over the vocabulary, their logits sharded over it; transformers' too); a checkpoint saved at tp 2 resumes on one rank."""

import json
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import Shard

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
from verst.models.factory import init_model
from verst.trainer import ForwardOutputs, MicroBatch, TrainItem
from verst.trainer.batching import transformers_slices_by_mask

VOCAB = 256  # the tiny tokenizer's byte tokens; its vocabulary has 265 rows, which tp 2 splits 133 / 132
PAD = 256


def pg_loss(outputs: ForwardOutputs, batch: MicroBatch, normalizer: float):
    per_token = -batch["advantages"] * outputs.logprobs * batch.loss_mask
    return per_token.sum() / normalizer, {}


def entropy_bonus_loss(outputs: ForwardOutputs, batch: MicroBatch, normalizer: float):
    """`pg_loss` with an entropy bonus, as RL recipes set (`algorithm.entropy_coef`): its gradient reaches every
    vocabulary row through the vocabulary-parallel entropy."""
    loss, metrics = pg_loss(outputs, batch, normalizer)
    return loss - 0.01 * (outputs.entropy * batch.loss_mask).sum() / normalizer, metrics


def make_items() -> list[TrainItem]:
    """Random tokens, and the padding token (256, on the second rank's rows of the vocabulary) in two prompts: its
    embedding row gets no gradient through the lookup."""
    g = torch.Generator().manual_seed(5)
    items = [TrainItem(torch.randint(0, VOCAB, (p + r,), generator=g), r, torch.ones(r),
                       {"advantages": torch.randn(r, generator=g)}, i) for i, (p, r) in enumerate(LENGTHS)]
    items[1].tokens[0] = items[3].tokens[2] = PAD
    return items


def one_step(backend, directory: str) -> dict:
    """Logprobs and entropy, one train step: its loss, gradients and updated weights."""
    items = make_items()
    logprobs, entropy = backend.logprobs(items, with_entropy=True)
    metrics = backend.train_step(items, pg_loss)
    return {"logprobs": logprobs, "entropy": entropy, "metrics": metrics, "grads": gradients(backend),
            "weights": synced_weights(backend)}


def one_step_with_entropy_bonus(backend, directory: str) -> dict:
    """Logprobs and entropy, one train step with `entropy_bonus_loss`: its loss and gradients."""
    items = make_items()
    logprobs, entropy = backend.logprobs(items, with_entropy=True)
    metrics = backend.train_step(items, entropy_bonus_loss, with_entropy=True)
    return {"logprobs": logprobs, "entropy": entropy, "metrics": metrics, "grads": gradients(backend)}


def one_step_with_shapes(backend, directory: str) -> dict:
    """`one_step`, and the width of every forward's rows with the width of the residual stream the first decoder
    layer returns on this rank: [(row width, layer output width)]."""
    layout = vocabulary_layout(backend)
    widths: list[list[int]] = []
    backend.model.register_forward_pre_hook(lambda _, args, kwargs: widths.append([kwargs["input_ids"].shape[1]]),
                                            with_kwargs=True, prepend=True)
    backend.model.model.layers[0].register_forward_hook(lambda _, args, out: widths[-1].append(out.shape[1]))
    return {**one_step(backend, directory), **layout, "widths": widths}


def vocabulary_layout(backend) -> dict:
    """How the embedding and head are laid out: the rows of the embedding weight this rank holds, whether the head
    is the embedding's parameter, and the placements of the logits a forward returns."""
    model = backend.model
    embedding = model.model.embed_tokens.weight  # FSDP2's shard over "dp" (of size 1) of the tensor-parallel one
    layout = {"embedding_rows": embedding.to_local().shape[0], "tied": model.lm_head.weight is embedding}
    with torch.no_grad():
        logits = model(input_ids=make_items()[0].tokens[None]).logits
    return {**layout, "logits": logits.placements if hasattr(logits, "placements") else None}


def one_step_with_vocabulary(backend, directory: str) -> dict:
    layout = vocabulary_layout(backend)
    return {**one_step(backend, directory), **layout}


def one_step_with_collectives(backend, directory: str) -> dict:
    """`one_step_with_shapes`, and the collectives of one forward of the native model by name."""
    from torch.distributed.tensor.debug import CommDebugMode

    comms, ids = CommDebugMode(), make_items()[0].tokens[None]  # [1, 9]
    with comms, torch.no_grad():  # the model's forward alone (a vocabulary-parallel head's logits stay a DTensor)
        backend.model(input_ids=ids)
    counts = {str(op).removeprefix("c10d_functional."): n for op, n in comms.get_comm_counts().items()}
    return {**one_step_with_shapes(backend, directory), "comms": counts, "layers": len(backend.model.model.layers)}


def save_then_step(backend, directory: str) -> dict:
    """One step, a checkpoint and an HF export, then a second step from it."""
    backend.train_step(make_items(), pg_loss)
    backend.save(f"{directory}/checkpoint")
    backend.export_hf(f"{directory}/saved-hf")
    backend.train_step(make_items(), pg_loss)
    return {"weights": synced_weights(backend)}


def resume_then_step(backend, directory: str) -> dict:
    """The checkpoint `save_then_step` wrote, loaded on this mesh, exported, and the same second step."""
    backend.load(f"{directory}/checkpoint")
    backend.export_hf(f"{directory}/resumed-hf")
    backend.train_step(make_items(), pg_loss)
    return {"weights": synced_weights(backend)}


def _rank(rank: int, world: int, tp: int, port: int, model_path: str, job, directory: str, out: str,
          impl: str = "auto", sequence_parallel: bool = False, packing: bool = False,
          checkpointing: bool = False) -> None:
    """One trainer rank running `job(backend, directory)`; rank 0 writes what it returned."""
    import torch.distributed as dist

    from verst.trainer import FSDP2Backend
    from verst.trainer.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        config = TrainerConfig(lr=LR, max_tokens_per_micro_batch=40, grad_clip=1e9, tensor_parallel_size=tp,
                               sequence_parallel=sequence_parallel, gradient_checkpointing=checkpointing)
        backend = FSDP2Backend(ModelConfig(path=model_path, impl=impl), config, device="cpu", packing=packing)
        result = job(backend, directory)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, tp: int, model_path, tmp_path, job=one_step, directory=None, impl="auto",
              sequence_parallel=False, packing=False, checkpointing=False) -> dict:
    out = tmp_path / (f"{job.__name__}-world{world}-tp{tp}-{impl}-sp{sequence_parallel:d}-packed{packing:d}"
                      f"-checkpointing{checkpointing:d}.pkl")
    args = (world, tp, free_port(), str(model_path), job, str(directory or tmp_path), str(out), impl,
            sequence_parallel, packing, checkpointing)
    return spawn_ranks(_rank, world, args, out, TIMEOUT_S)


def untie(path):
    """The checkpoint with its own LM head (a copy of the embedding, perturbed): a vocabulary-parallel head."""
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(path / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed + 0.01 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(1))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def cases(names: str, fast: list[tuple], slow: list[tuple]) -> pytest.MarkDecorator:
    """The tests' layouts by head (`model_path`: "tied" or "untied") and the other `names`: `make test` runs the `fast`
    ones, which cover each head and each layout once; the other combinations are `slow`."""
    ids = lambda case: "-".join(str(v) for v in case)  # noqa: E731
    params = [pytest.param(*case, id=ids(case)) for case in fast]
    params += [pytest.param(*case, id=ids(case), marks=pytest.mark.slow) for case in slow]
    return pytest.mark.parametrize(names, params, indirect=["model_path"], scope="module")


SP, NO_SP = "sequence-parallel", "no-sp"


@pytest.fixture(scope="module", params=["tied", "untied"])
def model_path(request, tmp_path_factory):
    path = init_model("qwen3", "tiny", tmp_path_factory.mktemp("tp") / "tiny-qwen3", seed=3)
    return untie(path) if request.param == "untied" else path


@pytest.fixture(scope="module")
def single(model_path, tmp_path_factory):
    return run_ranks(1, 1, model_path, tmp_path_factory.mktemp("single"))


def assert_same(got: dict, want: dict, atol: float = 1e-5) -> None:
    for name in ("logprobs", "entropy"):
        for a, b in zip(got[name], want[name], strict=True):
            torch.testing.assert_close(a, b, atol=atol, rtol=0)
    assert got["metrics"]["train/loss"] == pytest.approx(want["metrics"]["train/loss"], abs=atol)
    assert got["metrics"]["train/grad_norm"] == pytest.approx(want["metrics"]["train/grad_norm"], rel=atol)
    assert_tensors_close(got["grads"], want["grads"], atol)
    assert_tensors_close(got["weights"], want["weights"], atol)


def test_tensor_parallel_2_equals_one_rank(model_path, single, tmp_path):
    """The embedding and the head (tied or not) split over the vocabulary: half its rows on each rank, logits
    sharded over the vocabulary."""
    got = run_ranks(2, 2, model_path, tmp_path, one_step_with_vocabulary)
    assert_vocabulary_parallel(got, model_path)
    assert_same(got, single)


@cases("model_path", fast=[("tied",)], slow=[("untied",)])
def test_an_entropy_bonus_at_tensor_parallel_2_has_the_gradients_of_one_rank(model_path, tmp_path):
    """The entropy of logits sharded over the vocabulary, and its gradient to every row of the head (the weights
    after the step are left out: AdamW's first step moves a weight by about lr x the sign of its gradient, and the
    bonus gives many rows gradients near zero, whose sign float32 sums in another order may flip)."""
    want = run_ranks(1, 1, model_path, tmp_path, one_step_with_entropy_bonus)
    got = run_ranks(2, 2, model_path, tmp_path, one_step_with_entropy_bonus)
    assert_same({**got, "weights": {}}, {**want, "weights": {}})


def assert_vocabulary_parallel(got: dict, model_path, split: bool = True) -> None:
    """The embedding and head split over the vocabulary (`split`), or whole on each rank (transformers' model in
    releases without a boolean `logits_to_keep`, such as the floor's 5.17)."""
    assert got["embedding_rows"] == (133 if split else 265), got["embedding_rows"]  # rank 0's
    assert got["tied"] == json.loads((model_path / "config.json").read_text())["tie_word_embeddings"]
    assert got["logits"] in (((Shard(-1),), (Shard(2),)) if split else (None,)), got["logits"]  # [batch, seq, vocab]


@cases("model_path,layout", fast=[("tied", NO_SP), ("untied", SP)], slow=[("untied", NO_SP), ("tied", SP)])
def test_transformers_model_at_tensor_parallel_2_equals_one_rank(layout, model_path, tmp_path):
    """The same plan on transformers' Qwen3 (its embedding and head split over the vocabulary), against transformers' model on one rank; with
    sequence parallelism, the residual stream its first decoder layer returns holds half of every row's positions."""
    want, sequence_parallel = run_ranks(1, 1, model_path, tmp_path, impl="transformers"), layout == SP
    job = one_step_with_shapes if sequence_parallel else one_step_with_vocabulary
    got = run_ranks(2, 2, model_path, tmp_path, job, impl="transformers", sequence_parallel=sequence_parallel)
    assert_vocabulary_parallel(got, model_path, split=transformers_slices_by_mask())
    if sequence_parallel:
        assert any(width % 2 for width, _ in got["widths"])
        assert all(layer == (width + 1) // 2 for width, layer in got["widths"]), got["widths"]
    assert_same(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["", "sequence-parallel"])
def test_data_2_by_tensor_2_equals_one_rank(sequence_parallel, model_path, single, tmp_path):
    assert_same(run_ranks(4, 2, model_path, tmp_path, sequence_parallel=sequence_parallel), single)


@cases("model_path,world,layout", fast=[("tied", 2, NO_SP), ("untied", 2, SP)],
       slow=[("untied", 2, NO_SP), ("tied", 2, SP), *((head, 4, layout) for head in ("tied", "untied")
                                                     for layout in (NO_SP, SP))])
def test_a_checkpoint_saved_tensor_parallel_resumes_on_one_rank(world, layout, model_path, tmp_path):
    """Saved at dp (world / 2) x tp 2 (with sequence parallelism or without), resumed at dp 1 x tp 1 (DCP
    reshards): the same HF export, and the next step's weights within 1e-6."""
    saved = run_ranks(world, 2, model_path, tmp_path, save_then_step, sequence_parallel=layout == SP)
    resumed = run_ranks(1, 1, model_path, tmp_path, resume_then_step)
    assert_resumed_alike(saved, resumed, tmp_path)


@pytest.fixture(scope="module")
def single_packed(model_path, tmp_path_factory):
    return run_ranks(1, 1, model_path, tmp_path_factory.mktemp("single-packed"), packing=True)


@cases("model_path,rows", fast=[("tied", "packed"), ("untied", "padded")], slow=[("untied", "packed"), ("tied", "padded")])
def test_sequence_parallel_at_tensor_parallel_2_equals_one_rank(rows, model_path, single, single_packed, tmp_path):
    """Rows whose widths are odd (packed rows of several sequences, or one padded sequence per row): the residual
    stream a decoder layer returns holds half of every row's positions on each rank (the row widened by one
    position when its width is odd); a forward gathers each layer's attention and MLP input once and
    reduce-scatters their outputs (no all-reduce), reduce-scatters the embedding's partial rows onto the shares and
    gathers the rows once for the head; and everything the single rank computes is the same."""
    packing = rows == "packed"
    got = run_ranks(2, 2, model_path, tmp_path, one_step_with_collectives, sequence_parallel=True, packing=packing)
    assert any(width % 2 for width, _ in got["widths"])
    assert all(layer == (width + 1) // 2 for width, layer in got["widths"]), got["widths"]
    layers, comms = got["layers"], got["comms"]
    assert comms["reduce_scatter_tensor"] == 2 * layers + 1, comms
    assert comms["all_gather_into_tensor"] == 2 * layers + 1, comms
    assert "all_reduce" not in comms, comms
    assert_vocabulary_parallel(got, model_path)
    assert_same(got, single_packed if packing else single)


@cases("model_path", fast=[("untied",)], slow=[("tied",)])
def test_sequence_parallel_under_activation_checkpointing_equals_one_rank(model_path, single_packed, tmp_path):
    """Each decoder layer recomputed in backward, its gathers and reduce-scatters with it."""
    got = run_ranks(2, 2, model_path, tmp_path, sequence_parallel=True, packing=True, checkpointing=True)
    assert_same(got, single_packed)


def _both_from_shards(rank: int, world: int, port: int, out: str) -> None:
    """One rank of `vocab_parallel_logprobs` with the entropy, on logits sharded over an 11-token vocabulary
    (chunks 4, 4, 3 over 3 ranks): its results, the gradients of its shard and the collectives it issued."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from verst.trainer.tensor_parallel import vocab_parallel_logprobs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        logits, targets = _logits_and_targets()
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        sharded = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        comms = CommDebugMode()
        with comms:
            chosen, entropy = vocab_parallel_logprobs(sharded, targets, 0.7, with_entropy=True)
        (chosen * torch.arange(1.0, 7.0) + entropy).sum().backward()
        counts = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
        grads = [None] * world
        dist.all_gather_object(grads, sharded.grad.to_local())
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump({"chosen": chosen.detach(), "entropy": entropy.detach(), "grad": torch.cat(grads, 1),
                             "comms": counts}, f)
    finally:
        dist.destroy_process_group()


def _logits_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(3)) * 3
    return logits, torch.tensor([0, 3, 4, 7, 8, 10])  # a target in every chunk, at both ends of each


def test_the_logprobs_and_entropy_of_a_vocabulary_parallel_head_come_from_one_log_sum_exp(tmp_path):
    """Logits over 11 tokens on 3 ranks (4, 4, 3), targets in every chunk, a loss weighting the entropy as much as
    the logprobs: the chosen logprobs, the entropy and the gradient of each shard equal one rank's, from two
    all-reduces (the max; Σ e^z, Σ e^z z and the target's logit at once)."""
    from verst.models.scoring import token_logprobs

    out = tmp_path / "both.pkl"
    got = spawn_ranks(_both_from_shards, 3, (3, free_port(), str(out)), out, TIMEOUT_S)
    logits, targets = _logits_and_targets()
    logits.requires_grad_()
    chosen, log_probs = token_logprobs(logits, targets, 0.7)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    (chosen * torch.arange(1.0, 7.0) + entropy).sum().backward()
    assert_tensors_close({name: got[name] for name in ("chosen", "entropy", "grad")},
                         {"chosen": chosen.detach(), "entropy": entropy.detach(), "grad": logits.grad}, 1e-5)
    assert got["comms"] == {"allreduce_": 2}, got["comms"]
