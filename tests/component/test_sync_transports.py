"""Each weight transport end to end: a real one-rank FSDP2 trainer takes a train step, the syncer pushes
its weights to two real embedded engines served on loopback, and the engines then serve exactly the
trainer's new weights (greedy ids equal, logprobs within 1e-4) under a higher version on every engine.
Also: versions never go back, a failing engine is named and leaves nobody paused, the check mode."""

import asyncio
import gc
import glob

import pytest
import torch
import torch.distributed as dist

from verst.config.schema import ModelConfig, SyncConfig, TrainerConfig
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer, EngineProcess
from verst.inference_client.fleet import EngineFleet
from verst.inference_client.tensor_payload import serialize_named_tensors
from verst.models.factory import init_model
from verst.models.loader import load_model, load_tokenizer
from verst.sync import LogprobChecker, VersionError, WeightCheckError, WeightSyncError, build_syncer, list_snapshots
from verst.trainer import FSDP2Backend, TrainItem, sft_loss_fn

torch.set_num_threads(1)
BUCKET = 2**17  # several buckets for a ~2 MB model
PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [49, 50, 43, 51, 52, 61], list(range(65, 90))]
TRANSPORTS = ["distributed", "tensor", "disk"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("sync") / "tiny-qwen3", seed=5)


def serve(path, seed=0) -> BackgroundServer:
    return BackgroundServer(EngineCore(load_model(path), load_tokenizer(path), EngineConfig(seed=seed)),
                            model_path=str(path))


@pytest.fixture(scope="module")
def engines(model_path):
    servers = [serve(model_path) for _ in range(2)]
    try:
        for server in servers:
            server.start()
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def trainer(model_path):
    backend = FSDP2Backend(ModelConfig(path=str(model_path)), TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=256),
                           device="cpu")
    yield backend
    if dist.is_initialized():
        dist.destroy_process_group()


def train_step(trainer, seed):
    g = torch.Generator().manual_seed(seed)
    items = [TrainItem(torch.randint(0, 256, (20,), generator=g), 12, torch.ones(12), {}, i) for i in range(4)]
    trainer.train_step(items, sft_loss_fn)


def trainer_weights(trainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for bucket in trainer.named_weights(1 << 30) for name, t in bucket}


def reference_greedy(model_path, weights, n=8) -> list[list[int]]:
    model = load_model(model_path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    out = []
    for prompt in PROMPTS:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


async def greedy(fleet) -> dict[str, list]:
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    return await fleet.each("greedy", lambda c: asyncio.gather(*(c.generate(p, params) for p in PROMPTS)))


def assert_serves(trainer, model_path, results: dict[str, list], version: int) -> None:
    """Every engine's greedy ids equal a reference model holding the trainer's weights, logprobs 1e-4."""
    want_ids = reference_greedy(model_path, trainer_weights(trainer))
    for url, replies in results.items():
        assert [r.output_ids for r in replies] == want_ids, url
        assert {r.weight_version for r in replies} == {str(version)}, url
        items = [TrainItem(p + r.output_ids, len(r.output_ids), torch.ones(len(r.output_ids)), {}, i)
                 for i, (p, r) in enumerate(zip(PROMPTS, replies))]
        for got, r in zip(trainer.logprobs(items), replies):
            torch.testing.assert_close(torch.tensor(r.logprobs), got, atol=1e-4, rtol=0)


async def paused(fleet) -> dict[str, bool]:
    infos = await fleet.each("get_server_info", lambda c: c.get_server_info())
    return {url: info["internal_states"][0]["paused"] for url, info in infos.items()}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_train_step_then_a_sync_serves_the_new_weights_on_every_engine(transport, engines, trainer, model_path,
                                                                        tmp_path):
    cfg = SyncConfig(transport=transport, bucket_bytes=BUCKET)

    async def main():
        async with EngineFleet(engines) as fleet:
            syncer = build_syncer(cfg, fleet, snapshot_dir=tmp_path, keep_snapshots=2, source_model=model_path)
            before = await greedy(fleet)
            version = await syncer.current_version() + 1
            train_step(trainer, seed=version)
            metrics = await syncer.sync(trainer.named_weights(BUCKET), version)
            after = await greedy(fleet)
            versions = await fleet.weight_versions()
            # a second sync reuses the set-up (the distributed group) and moves the version again
            train_step(trainer, seed=100 + version)
            await syncer.sync(trainer.named_weights(BUCKET), version + 1)
            again = await greedy(fleet)
            await syncer.close()
            return syncer, before, after, again, versions, metrics, await paused(fleet)

    syncer, before, after, again, versions, metrics, paused_now = asyncio.run(main())
    version = int(next(iter(versions.values())))
    assert versions == {url: str(version) for url in engines}
    assert not any(paused_now.values())
    assert metrics["sync/buckets"] > 2 and metrics["sync/bytes"] == sum(
        t.numel() * 4 for t in trainer_weights(trainer).values())
    assert metrics["sync/version"] == version and metrics["sync/seconds"] >= metrics["sync/push_seconds"] > 0
    assert_serves(trainer, model_path, again, version + 1)
    # the step moved the weights: the logprobs the engines served before the sync are now stale
    url = engines[0]
    assert max(abs(a - b) for r0, r1 in zip(before[url], after[url]) for a, b in zip(r0.logprobs, r1.logprobs)) > 1e-3
    if transport == "distributed":
        assert syncer.transport.groups_built == 1
    if transport == "disk":
        assert [v for v, _ in list_snapshots(tmp_path)] == [version, version + 1]
        # a snapshot is a complete checkpoint: transformers loads it with the trainer's weights
        model = load_model(list_snapshots(tmp_path)[-1][1])
        for name, tensor in trainer_weights(trainer).items():
            torch.testing.assert_close(model.state_dict()[name], tensor, atol=0, rtol=0)


def test_versions_never_go_back(engines, trainer):
    async def main():
        async with EngineFleet(engines) as fleet:
            syncer = build_syncer(SyncConfig(transport="tensor", bucket_bytes=BUCKET), fleet)
            current = await syncer.current_version()
            for stale in (current, current - 1):
                with pytest.raises(VersionError, match=f"sync version {stale} but the engines serve version {current}"):
                    await syncer.sync(trainer.named_weights(BUCKET), stale)
            return current, await fleet.weight_versions(), await paused(fleet)

    current, versions, paused_now = asyncio.run(main())
    assert set(versions.values()) == {str(current)} and not any(paused_now.values())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failing_engine_is_named_and_no_engine_is_left_paused(transport, engines, trainer, tmp_path):
    # an engine serving another architecture (llama has no q_norm/k_norm) refuses the trainer's tensors
    other = init_model("llama", "tiny", tmp_path / "llama")
    with serve(other) as bad:
        async def main():
            async with EngineFleet([engines[0], bad.url]) as fleet:
                syncer = build_syncer(SyncConfig(transport=transport, bucket_bytes=BUCKET), fleet,
                                      snapshot_dir=tmp_path / "snapshots", timeout_s=5.0)
                version = await syncer.current_version() + 1
                with pytest.raises(WeightSyncError) as info:
                    await asyncio.wait_for(syncer.sync(trainer.named_weights(BUCKET), version), 60)
                return info.value, await paused(fleet), await fleet.weight_versions(), version

        error, paused_now, versions, version = asyncio.run(main())
    message = str(error)
    assert bad.url in message and "not a weight of the model" in message and "Every engine was continued" in message
    assert engines[0] not in message.split("failed:", 1)[1]  # only the failing engine is blamed
    assert paused_now == {engines[0]: False, bad.url: False}
    assert str(version) not in versions.values()


def test_distributed_rebuilds_its_group_after_a_failed_push(engines, trainer, model_path):
    bogus = [("model.layers.0.not_a_weight", torch.zeros(3))]

    async def main():
        async with EngineFleet(engines) as fleet:
            syncer = build_syncer(SyncConfig(transport="distributed", bucket_bytes=BUCKET), fleet, timeout_s=5.0)
            version = await syncer.current_version() + 1
            with pytest.raises(WeightSyncError, match="not_a_weight"):
                await syncer.sync([bogus], version)
            train_step(trainer, seed=7)
            await syncer.sync(trainer.named_weights(BUCKET), version)
            return syncer.transport.groups_built, await greedy(fleet), version

    groups, results, version = asyncio.run(main())
    assert groups == 2
    assert_serves(trainer, model_path, results, version)


def test_check_mode_passes_on_correct_weights_and_fails_on_a_corrupted_engine(engines, trainer):
    cfg = SyncConfig(transport="tensor", bucket_bytes=BUCKET, check_weights=True)

    async def main():
        async with EngineFleet(engines) as fleet:
            syncer = build_syncer(cfg, fleet, logprobs_fn=trainer.logprobs)
            version = await syncer.current_version() + 1
            train_step(trainer, seed=11)
            first = await syncer.sync(trainer.named_weights(BUCKET), version)
            second = await syncer.sync(trainer.named_weights(BUCKET), version + 1)
            # corrupt one tensor on the second engine only, keeping its version string
            weights = trainer_weights(trainer)
            name = "model.layers.1.mlp.down_proj.weight"
            corrupted = [serialize_named_tensors([(name, weights[name] + 0.05)])]
            await fleet.clients[engines[1]].update_weights_from_tensor(corrupted, str(version + 1))
            with pytest.raises(WeightCheckError) as info:
                await LogprobChecker(trainer.logprobs).check(fleet, version + 1)
            await syncer.sync(trainer.named_weights(BUCKET), version + 2)  # leave the engines correct
            return first, second, info.value

    first, second, error = asyncio.run(main())
    assert first["sync/check_max_abs_diff"] < 1e-4 and "sync/check_seconds" not in second
    assert list(error.mismatches) == [engines[1]] and engines[1] in str(error) and "engine logprob" in str(error)


def torch_shm_files() -> set[str]:
    gc.collect()  # transports other tests left unclosed free their buffers
    return set(glob.glob("/dev/shm/torch_*"))


def test_a_tensor_sync_copies_the_trainers_bytes_and_leaves_no_shared_memory_file(trainer, model_path):
    """SGLang's tensor format end to end, in-process engine: after the push every engine parameter equals the
    trainer's bit for bit, and once the transport closes no shared-memory file of the push is left."""
    before = torch_shm_files()
    with serve(model_path) as server:
        async def main():
            async with EngineFleet([server.url]) as fleet:
                syncer = build_syncer(SyncConfig(transport="tensor", bucket_bytes=BUCKET), fleet)
                version = await syncer.current_version() + 1
                train_step(trainer, seed=31)
                await syncer.sync(trainer.named_weights(BUCKET), version)
                during = torch_shm_files() - before
                await syncer.close()
                return during

        during = asyncio.run(main())
        served = server.core.model.state_dict()
        for name, tensor in trainer_weights(trainer).items():
            assert torch.equal(served[name], tensor), name
    assert len(during) == 3  # the three staging buffers, kept between pushes
    assert not torch_shm_files() - before


def test_a_tensor_sync_to_an_engine_process_serves_the_trainers_logprobs_and_leaves_no_file(trainer, model_path):
    """The same across processes (`verst serve engine`): the engine maps the trainer's files by name."""
    before = torch_shm_files()
    engine = EngineProcess(model_path).start()
    try:
        async def main():
            async with EngineFleet([engine.url]) as fleet:
                syncer = build_syncer(SyncConfig(transport="tensor", bucket_bytes=BUCKET), fleet)
                version = await syncer.current_version() + 1
                for step in range(2):  # the second push reuses the staging buffers
                    train_step(trainer, seed=41 + step)
                    await syncer.sync(trainer.named_weights(BUCKET), version + step)
                check = await LogprobChecker(trainer.logprobs).check(fleet, version + 1)
                await syncer.close()
                return check, await greedy(fleet), version + 1

        check, results, version = asyncio.run(main())
    finally:
        engine.stop()
    assert check["sync/check_max_abs_diff"] <= 1e-4
    assert_serves(trainer, model_path, results, version)
    assert not torch_shm_files() - before


@pytest.mark.slow
def test_every_transport_across_processes(model_path, trainer, tmp_path):
    """The same, with engines in child processes (`verst serve engine`): shared memory mapped by another
    process, a gloo group spanning processes, snapshots read by another process."""
    engines = [EngineProcess(model_path).start(wait=False) for _ in range(2)]
    try:
        for engine in engines:
            engine.wait_ready()
        urls = [engine.url for engine in engines]

        async def main(transport):
            async with EngineFleet(urls) as fleet:
                syncer = build_syncer(SyncConfig(transport=transport, bucket_bytes=BUCKET), fleet,
                                      snapshot_dir=tmp_path / transport, logprobs_fn=trainer.logprobs)
                version = await syncer.current_version() + 1
                for step in range(2):
                    train_step(trainer, seed=200 + version + step)
                    await syncer.sync(trainer.named_weights(BUCKET), version + step)
                await LogprobChecker(trainer.logprobs).check(fleet, version + 1)
                await syncer.close()
                return await greedy(fleet), version + 1, await paused(fleet)

        for transport in TRANSPORTS:
            results, version, paused_now = asyncio.run(main(transport))
            assert_serves(trainer, model_path, results, version)
            assert not any(paused_now.values())
    finally:
        for engine in engines:
            engine.stop()
