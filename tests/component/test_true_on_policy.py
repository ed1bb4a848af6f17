"""`algorithm.true_on_policy` between an in-process engine and the FSDP2 backend on CPU float32: the
engine's reported logprobs equal the trainer's bit for bit, however the engine batched the requests,
before and after a weight sync; the engine refuses what would break it."""

import pytest
import torch
import torch.distributed as dist

from tests.parity import as_items, rollout
from verst.config.schema import ModelConfig, TrainerConfig
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.request import Request
from verst.inference_client.protocol import InvalidRequest, SamplingParams
from verst.models.loader import load_model, load_tokenizer
from verst.models.native import load_causal_lm
from verst.trainer import FSDP2Backend, sft_loss_fn

TEMPERATURE = 0.8
PROMPTS = [[72, 105, 33], [49, 50, 43, 51, 52, 61], list(range(65, 85)), [263]]


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def engine(path, **config):
    return EngineCore(load_causal_lm(path), load_tokenizer(path), EngineConfig(seed=0, true_on_policy=True, **config))


def exact(backend, requests):
    items = as_items(requests)
    return all(torch.equal(got, item.extras["rollout_logprobs"]) for got, item in zip(backend.logprobs(items), items))


def test_engine_and_trainer_logprobs_are_bitwise_equal_before_and_after_a_weight_sync(tiny_model_dir):
    backend = FSDP2Backend(ModelConfig(path=str(tiny_model_dir)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=80),
                           temperature=TEMPERATURE, device="cpu", per_sequence=True)
    batched, alone = engine(tiny_model_dir), engine(tiny_model_dir, max_running_requests=1)
    first = rollout(batched, "0", PROMPTS, TEMPERATURE)
    assert exact(backend, first)
    # one request at a time: other batch shapes in the engine, the same logprobs
    assert [r.output_logprobs for r in rollout(alone, "0", PROMPTS, TEMPERATURE)] == [r.output_logprobs for r in first]
    backend.train_step(as_items(first), sft_loss_fn)
    for bucket in backend.named_weights(bucket_bytes=1 << 18):
        batched.load_weights(bucket, version=None, flush=False)
    batched.load_weights([], version="1")
    second = rollout(batched, "1", PROMPTS, TEMPERATURE)
    assert exact(backend, second) and not exact(backend, first)


def test_the_engine_refuses_what_true_on_policy_cannot_hold_for(tiny_model_dir):
    with pytest.raises(ValueError, match="true_on_policy needs the native model class in float32 on the CPU"):
        EngineCore(load_model(tiny_model_dir), None, EngineConfig(true_on_policy=True))
    with pytest.raises(InvalidRequest, match="LoRA adapters are not served"):
        engine(tiny_model_dir).add_request(Request("r", [1, 2], SamplingParams(max_new_tokens=2), lora_path="a"))
