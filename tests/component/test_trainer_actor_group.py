"""The trainer rank actors (`Orchestration.start_trainer`, a trainer-only placement on a local Ray, gloo
on loopback): FSDP2 over 2 ranks against 1 rank, resume in new processes, and failures that must raise
on the driver instead of hanging."""

import contextlib
import functools
import os
import sys
import time

import pytest
import ray
import torch
import torch.distributed as dist

from tests.processes import wait_gone
from verst.config.schema import ClusterConfig, ModelConfig, TrainerConfig
from verst.models.factory import init_model
from verst.orchestration import Orchestration, RaySession
from verst.trainer import FSDP2Backend, RankError, TrainItem, sft_loss_fn

CONFIG = TrainerConfig(
    lr=1e-3, lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.1, max_tokens_per_micro_batch=40, seed=7
)
TOTAL_STEPS = 4


def batch(lengths, seed) -> list[TrainItem]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, (prompt, response) in enumerate(lengths):
        mask = torch.ones(response)
        mask[: response // 3] = 0.0  # some env tokens
        items.append(TrainItem(torch.randint(0, 256, (prompt + response,), generator=g), response, mask, {}, i))
    return items


# Odd sizes and a single-sequence batch: the ranks get unequal micro-batch counts, and in step 3 one
# rank has no sequence at all and must run a dummy micro-batch to keep the collectives in step.
BATCHES = [
    batch([(5, 4), (9, 7), (3, 12), (20, 6), (4, 3), (2, 9), (7, 7)], seed=0),
    batch([(12, 10), (3, 3), (8, 8), (5, 14), (6, 2)], seed=1),
    batch([(6, 9)], seed=2),
    batch([(4, 4), (4, 6), (4, 8), (10, 10), (3, 5), (9, 2)], seed=3),
]


def failing_loss(outputs, micro, normalizer):
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return sft_loss_fn(outputs, micro, normalizer)


def exiting_loss(outputs, micro, normalizer):
    if dist.get_rank() == 1:
        os._exit(7)
    return sft_loss_fn(outputs, micro, normalizer)


def sleeping_loss(outputs, micro, normalizer):
    time.sleep(60)
    return sft_loss_fn(outputs, micro, normalizer)


# The loss fns above travel to the rank actors by value: importing this module there would cost each
# rank the imports at the top of this file, and tests/ need not be importable there.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def ray_session():
    with RaySession(slots=2, log_to_driver=False) as session:
        yield session


@contextlib.contextmanager
def trainer_ranks(factory, world_size, timeout_s, start_timeout_s=300.0):
    """`world_size` rank actors of `factory()` in a trainer-only placement; stopped on exit."""
    cluster = ClusterConfig(trainer_ranks=world_size, device="cpu")
    with Orchestration(cluster, engines=False, timeout_s=timeout_s, start_timeout_s=start_timeout_s) as orch:
        yield orch.start_trainer(factory)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("trainer-group") / "tiny-qwen3", seed=5)


def factory(path, **overrides):
    return functools.partial(FSDP2Backend, ModelConfig(path=str(path)), CONFIG.model_copy(update=overrides),
                             total_steps=TOTAL_STEPS, device="cpu")


def all_weights(source) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in source.named_weights(1 << 30) for name, t in bucket}


@pytest.fixture(scope="module")
def two_rank_run(ray_session, model_path, tmp_path_factory):
    """4 uninterrupted steps on 2 ranks, saving a checkpoint after step 2 (saving changes nothing)."""
    ckpt = tmp_path_factory.mktemp("trainer-group-ckpt") / "step2"
    run = {"ckpt": ckpt, "metrics": [], "weights": []}
    with trainer_ranks(factory(model_path), world_size=2, timeout_s=120) as group:
        run["logprobs"] = group.logprobs(BATCHES[0])
        first = next(iter(group.named_weights(bucket_bytes=1 << 16)))  # stop early: the rest is drained
        run["first_bucket"] = first
        for step, items in enumerate(BATCHES):
            run["metrics"].append(group.train_step(items, sft_loss_fn))
            run["weights"].append(all_weights(group))
            if step == 1:
                group.save(ckpt)
    return run


def test_two_ranks_match_one_rank(model_path, two_rank_run):
    one = FSDP2Backend(ModelConfig(path=str(model_path)), CONFIG, total_steps=TOTAL_STEPS, device="cpu")
    try:
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        for got, it in zip(two_rank_run["logprobs"], BATCHES[0]):
            with torch.no_grad():
                logits = plain(it.tokens[None]).logits[0, it.prompt_length - 1 : -1]
            want = torch.log_softmax(logits, -1).gather(-1, it.tokens[it.prompt_length :, None])[:, 0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert [n for n, _ in two_rank_run["first_bucket"]][0] == "model.embed_tokens.weight"
        for step in range(3):
            want = one.train_step(BATCHES[step], sft_loss_fn)
            got = two_rank_run["metrics"][step]
            assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
            assert got["train/lr"] == pytest.approx(want["train/lr"], rel=1e-12)
            assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4)
        for name, tensor in all_weights(one).items():
            torch.testing.assert_close(two_rank_run["weights"][2][name], tensor, atol=1e-4, rtol=0)
    finally:
        dist.destroy_process_group()


def test_resume_in_new_processes_continues_exactly(model_path, two_rank_run):
    with trainer_ranks(factory(model_path), world_size=2, timeout_s=120) as group:
        group.load(two_rank_run["ckpt"])
        assert group.step == 2
        resumed = [group.train_step(items, sft_loss_fn) for items in BATCHES[2:]]
        weights = all_weights(group)
    for got, want in zip(resumed, two_rank_run["metrics"][2:]):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-6)
        assert got["train/lr"] == pytest.approx(want["train/lr"], rel=1e-6)
    for name, tensor in two_rank_run["weights"][3].items():
        torch.testing.assert_close(weights[name], tensor, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "loss_fn, message", [(failing_loss, "ValueError: boom on rank 1"), (exiting_loss, "process died")]
)
def test_a_failing_rank_raises_on_the_driver_and_stops_the_group(ray_session, model_path, loss_fn, message):
    with trainer_ranks(factory(model_path), world_size=2, timeout_s=60) as group:
        pids = group.pids
        with pytest.raises(RankError, match=message) as failure:
            group.train_step(BATCHES[0], loss_fn)
        assert failure.value.rank == 1
        assert wait_gone(pids) == []
        with pytest.raises(RuntimeError, match="shut down"):
            group.logprobs(BATCHES[0])


def test_a_stuck_call_times_out_instead_of_hanging(ray_session, model_path):
    with trainer_ranks(factory(model_path), world_size=1, timeout_s=3, start_timeout_s=120) as group:
        pids = group.pids
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish 'train_step' within 3 s"):
            group.train_step(BATCHES[0], sleeping_loss)
        assert time.monotonic() - start < 30
        assert wait_gone(pids) == []


def test_a_rank_that_cannot_start_reports_its_traceback(ray_session, tmp_path):
    with pytest.raises(RankError, match="no-such-model"):
        with trainer_ranks(factory(tmp_path / "no-such-model"), world_size=2, timeout_s=60):
            pass
