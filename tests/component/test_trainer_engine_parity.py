"""DESIGN.md invariant: rollout logprobs and trainer logprobs of the same weights agree (float32 CPU,
1e-4), before and after a train step whose weights reach the engine through `named_weights` (with LoRA:
the merged weights, the trainer's adapters active), or with LoRA's adapter sync through `synced_weights`
(the adapter alone, served by name on the engine's untouched base, every request naming it)."""

import pytest
import torch
import torch.distributed as dist

from tests.parity import as_items, assert_parity, rollout
from verst.config.schema import LoraConfig, ModelConfig, TrainerConfig
from verst.engine.core import EngineConfig, EngineCore
from verst.models.factory import init_model
from verst.models.loader import load_model, load_tokenizer
from verst.trainer import FSDP2Backend, sft_loss_fn

TEMPERATURE = 0.8
PROMPTS = [[72, 105, 33], [49, 50, 43, 51, 52, 61], list(range(65, 85)), [263]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("trainer-parity") / "tiny-qwen3", seed=11)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("lora", [None, LoraConfig(enabled=True, rank=4, alpha=8.0)], ids=["full", "lora"])
def test_engine_and_trainer_logprobs_agree_before_and_after_a_weight_sync(model_path, lora):
    engine = EngineCore(load_model(model_path), load_tokenizer(model_path), EngineConfig(seed=0))
    backend = FSDP2Backend(
        ModelConfig(path=str(model_path)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=40),
        temperature=TEMPERATURE, device="cpu", lora=lora,
    )
    first = rollout(engine, "0", PROMPTS, TEMPERATURE)
    assert_parity(backend, first)
    for _ in range(1 if lora is None else 3):  # LoRA's first step only moves B away from 0
        backend.train_step(as_items(first), sft_loss_fn)
    for bucket in backend.named_weights(bucket_bytes=1 << 18):
        engine.load_weights(bucket, version=None, flush=False)
    engine.load_weights([], version="1")
    second = rollout(engine, "1", PROMPTS, TEMPERATURE)
    assert [r.weight_version for r in second] == ["1"] * len(PROMPTS)
    assert_parity(backend, second)
    stale = as_items(first)
    assert max((a - b).abs().max() for a, b in zip(backend.logprobs(stale), (i.extras["rollout_logprobs"] for i in stale))) > 1e-3


def test_engine_and_trainer_logprobs_agree_with_the_adapter_synced_alone(model_path):
    engine = EngineCore(load_model(model_path), load_tokenizer(model_path), EngineConfig(seed=0))
    base = {name: t.clone() for name, t in engine.model.state_dict().items()}
    backend = FSDP2Backend(
        ModelConfig(path=str(model_path)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=40),
        temperature=TEMPERATURE, device="cpu", lora=LoraConfig(enabled=True, rank=4, alpha=8.0, sync="adapter"),
    )
    name, config = backend.sync_adapter

    def push(version: str) -> None:
        tensors = {n: t for bucket in backend.synced_weights(bucket_bytes=1 << 30) for n, t in bucket}
        assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
        engine.add_lora(engine.build_lora(name, config, tensors), update_in_flight=True)
        engine.load_weights([], version=version)

    push("0")
    first = rollout(engine, "0", PROMPTS, TEMPERATURE, lora_path=name)
    assert_parity(backend, first)
    for _ in range(3):  # LoRA's first step only moves B away from 0
        backend.train_step(as_items(first), sft_loss_fn)
    push("1")
    second = rollout(engine, "1", PROMPTS, TEMPERATURE, lora_path=name)
    assert_parity(backend, second)
    stale = as_items(first)
    assert max((a - b).abs().max() for a, b in zip(backend.logprobs(stale), (i.extras["rollout_logprobs"] for i in stale))) > 1e-3
    # the base weights never moved; only the adapter changed
    assert all(torch.equal(t, engine.model.state_dict()[n]) for n, t in base.items())
