"""LoRA's adapter sync through each weight transport end to end: a one-rank FSDP2 trainer with PEFT adapters
takes LoRA steps, the syncer pushes the adapter alone to two real embedded engines on loopback, which serve
it by name on their untouched base: `sync/bytes` is the adapter's size, and the weight check (probes naming
the adapter) agrees with the trainer's logprobs within 1e-4 under the new version on every engine."""

import asyncio

import pytest
import torch
import torch.distributed as dist

from verst.config.schema import LoraConfig, ModelConfig, SyncConfig, TrainerConfig
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.fleet import EngineFleet
from verst.models.factory import init_model
from verst.models.loader import load_model, load_tokenizer
from verst.sync import AdapterSpec, build_syncer, list_snapshots
from verst.trainer import FSDP2Backend, TrainItem, sft_loss_fn

torch.set_num_threads(1)
TRANSPORTS = ["distributed", "tensor", "disk"]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("sync-lora") / "tiny-qwen3", seed=5)


@pytest.fixture(scope="module")
def engines(model_path):
    servers = [BackgroundServer(EngineCore(load_model(model_path), load_tokenizer(model_path), EngineConfig(seed=0)),
                                model_path=str(model_path)) for _ in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def trainer(model_path):
    backend = FSDP2Backend(ModelConfig(path=str(model_path)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=256),
                           temperature=TEMPERATURE, device="cpu", lora=LoraConfig(enabled=True, rank=4, alpha=8.0))
    yield backend
    if dist.is_initialized():
        dist.destroy_process_group()


def lora_steps(trainer, seed, n=2):
    g = torch.Generator().manual_seed(seed)
    items = [TrainItem(torch.randint(0, 256, (20,), generator=g), 12, torch.ones(12), {}, i) for i in range(4)]
    for _ in range(n):
        trainer.train_step(items, sft_loss_fn)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_adapter_sync_moves_only_the_adapter_and_the_check_passes_with_it_active(transport, engines, trainer,
                                                                                 model_path, tmp_path):
    base = {name: t.clone() for name, t in engines[0].core.model.state_dict().items()}
    name, config = trainer.sync_adapter
    cfg = SyncConfig(transport=transport, bucket_bytes=2**16, check_weights=True)
    urls = [server.url for server in engines]

    async def main():
        async with EngineFleet(urls) as fleet:
            syncer = build_syncer(cfg, fleet, logprobs_fn=trainer.logprobs, temperature=TEMPERATURE,
                                  adapter=AdapterSpec(name, config), snapshot_dir=tmp_path, source_model=model_path)
            version = await syncer.current_version()
            first = await syncer.sync(trainer.synced_weights(cfg.bucket_bytes), version, first=True)
            lora_steps(trainer, seed=version)
            metrics = await syncer.sync(trainer.synced_weights(cfg.bucket_bytes), version + 1)
            await syncer.close()
            return first, metrics, version + 1, await fleet.weight_versions()

    first, metrics, version, versions = asyncio.run(main())
    adapter = {n: t for bucket in trainer.synced_weights(1 << 30) for n, t in bucket}
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in adapter.values())
    assert metrics["sync/tensors"] == len(adapter) and metrics["sync/buckets"] == 1  # one bucket: the whole adapter
    assert "sync/check_max_abs_diff" not in first  # the step-0 push is not the checked one
    assert metrics["sync/check_max_abs_diff"] <= 1e-4
    assert versions == {url: str(version) for url in urls}
    for server in engines:  # the base never moved; the adapter is served under its name
        assert all(torch.equal(t, server.core.model.state_dict()[n]) for n, t in base.items())
        assert list(server.core.loras.adapters) == [name]
    if transport == "disk":
        snapshot = list_snapshots(tmp_path)[-1][1]
        assert sorted(p.name for p in snapshot.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                             "verst_snapshot.json"]
