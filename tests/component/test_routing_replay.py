"""Rollout routing replay (R3) between the engine and the trainer on a tiny Qwen3-MoE whose routing
differs between the two forwards: with replay the trainer's logprobs equal the engine's within 1e-6 on
the tokens where its own routing gives them away; the mismatch rate counts the differing choices."""

import pytest
import torch
import torch.distributed as dist

from tests.moe_models import near_tie_moe
from verst.config.schema import ModelConfig, TrainerConfig
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.request import Request
from verst.inference_client.protocol import SamplingParams
from verst.models.loader import load_model, load_tokenizer
from verst.trainer import FSDP2Backend, TrainItem, sft_loss_fn
from verst.trainer.routing import RoutingReplay

PROMPTS = [[72, 105, 33], [49, 50, 43, 51, 52, 61], list(range(65, 85)), [263], [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return near_tie_moe(tmp_path_factory.mktemp("r3") / "tiny-moe")


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def items(moe_path):
    engine = EngineCore(load_model(moe_path), load_tokenizer(moe_path), EngineConfig(seed=0))
    requests = [Request(f"r{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True,
                                                        sampling_seed=i),
                        return_logprob=True, return_routed_experts=True) for i, prompt in enumerate(PROMPTS)]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return [TrainItem(r.prompt_ids + r.output_ids, len(r.output_ids), torch.ones(len(r.output_ids)),
                      {"rollout_logprobs": r.output_logprobs}, i, r.experts_array()) for i, r in enumerate(requests)]


def backend(path, routing):
    return FSDP2Backend(ModelConfig(path=str(path)), TrainerConfig(lr=1e-3, max_tokens_per_micro_batch=80),
                        device="cpu", routing=routing)


def differences(trainer, items):
    got = trainer.logprobs(items)
    return torch.cat([(a - item.extras["rollout_logprobs"]).abs() for a, item in zip(got, items)])


def test_replay_matches_the_engine_where_the_trainers_own_routing_does_not(moe_path, items):
    measured = backend(moe_path, "measure")
    apart = differences(measured, items) > 1e-6
    mismatched, total = measured._routing.take_counts()
    assert apart.sum() >= 5 and 0 < mismatched < total  # a genuine routing difference, on many tokens
    replayed = differences(backend(moe_path, "replay"), items)
    assert replayed[apart].max() < 1e-6 and replayed.max() < 1e-6


@pytest.mark.parametrize("routing", ["measure", "replay"])
def test_train_step_logs_the_routing_mismatch_rate(moe_path, items, routing):
    metrics = backend(moe_path, routing).train_step(items, sft_loss_fn)
    assert 0.0 < metrics["train/routing_mismatch_rate"] < 0.5
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))


def test_replay_refuses_items_without_routed_experts(moe_path, items):
    bare = [TrainItem(it.tokens, it.response_length, it.loss_mask, it.extras, it.index) for it in items]
    with pytest.raises(ValueError, match="routing_replay = 'replay'.*no routed_experts"):
        backend(moe_path, "replay").logprobs(bare)


def test_replay_needs_an_moe_model(tiny_model_dir):
    with pytest.raises(ValueError, match="no MoE router"):
        RoutingReplay(load_model(tiny_model_dir), replay=True)
