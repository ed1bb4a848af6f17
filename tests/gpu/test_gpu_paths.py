"""The GPU paths verst is written for but cannot run on the CPU machines: FSDP2 with bf16 mixed
precision, the embedded engine on CUDA, the NCCL weight broadcast between two GPUs, the tensor transport's
CUDA-IPC handles to an engine colocated on one GPU, and the engine's memory release and resume with its
device memory measured. Run by `make test-gpu` (scripts/gpu/check.sh) on a machine with a CUDA GPU;
skipped elsewhere (and deselected by default)."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def make_samples(n: int = 8):
    from verst.types import Sample, Status

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = torch.randint(0, 256, (12 + i,), generator=g).tolist()
        resp = 4 + i % 3
        out.append(Sample(tokens=tokens, response_length=resp, loss_mask=[1] * resp, rollout_logprobs=[0.0] * resp,
                          status=Status.COMPLETED, index=i))
    return out


def test_fsdp2_bf16_step_on_cuda_tracks_float32(tiny_model_dir):
    from verst.config import ModelConfig, TrainerConfig
    from verst.trainer import FSDP2Backend, sft_loss_fn

    samples = make_samples()
    bf16 = FSDP2Backend(ModelConfig(path=str(tiny_model_dir), dtype="bfloat16"), TrainerConfig(lr=1e-4), device="cuda")
    lp_bf16 = bf16.logprobs(samples)
    metrics = bf16.train_step(samples, sft_loss_fn)
    assert torch.isfinite(torch.tensor(metrics["train/loss"])) and metrics["train/grad_norm"] > 0
    from verst.models import load_model

    ref = load_model(tiny_model_dir, device="cuda")
    with torch.no_grad():
        for s, lp in zip(samples, lp_bf16):
            logits = ref(torch.tensor([s.tokens], device="cuda")).logits[0, :-1].float()
            full = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.tokens[1:], device="cuda")[:, None])[:, 0]
            # bf16 compute vs float32: ~1e-2 (PLATFORM.md)
            assert torch.allclose(lp.float().cpu(), full[-s.response_length:].cpu(), atol=5e-2)


def test_engine_on_cuda_logprobs_match_forward(tiny_model_dir):
    from verst.engine.process import EngineProcess
    from verst.inference_client.client import EngineClient
    from verst.models import load_model

    prompt = [257, 49, 50, 43, 51, 52, 61]
    with EngineProcess(tiny_model_dir, args=["--device", "cuda"]) as engine:
        async def go():
            async with EngineClient(engine.url) as c:
                return await c.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 1})

        result = asyncio.run(go())
    model = load_model(tiny_model_dir, device="cuda")
    ids = torch.tensor([prompt + result.output_ids], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    expected = logp[len(prompt) - 1 :].gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
    assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-3)


def synced_with_check(tiny_model_dir, transport: str, engine_env: dict | None = None) -> dict:
    """A train step on cuda:0, then a push through `transport` to an engine process on CUDA, weight-checked."""
    from verst.config import ModelConfig, SyncConfig, TrainerConfig
    from verst.engine.process import EngineProcess
    from verst.inference_client.fleet import EngineFleet
    from verst.sync import LogprobChecker, build_syncer
    from verst.trainer import FSDP2Backend, sft_loss_fn

    trainer = FSDP2Backend(ModelConfig(path=str(tiny_model_dir)), TrainerConfig(lr=1e-3), device="cuda")
    trainer.train_step(make_samples(), sft_loss_fn)
    with EngineProcess(tiny_model_dir, args=["--device", "cuda", "--weight-version", "0"], env=engine_env) as engine:
        async def go():
            async with EngineFleet([engine.url]) as fleet:
                syncer = build_syncer(SyncConfig(transport=transport), fleet, device="cuda")
                try:
                    metrics = await syncer.sync(list(trainer.named_weights(1 << 28)), 1)
                finally:
                    await syncer.close()
                # float32 on CUDA: the engine's native forward and the trainer's transformers forward order their
                # sums differently, so the check allows 1e-3 where the CPU's allows 1e-4
                return {**metrics, **await LogprobChecker(trainer.logprobs, atol=1e-3).check(fleet, 1)}

        return asyncio.run(go())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL takes no two ranks on one GPU: needs two GPUs")
def test_nccl_weight_sync_to_an_engine_on_the_second_gpu(tiny_model_dir):
    metrics = synced_with_check(tiny_model_dir, "distributed", {"CUDA_VISIBLE_DEVICES": "1"})
    assert metrics["sync/version"] == 1 and metrics["sync/check_max_abs_diff"] < 1e-3


def test_cuda_ipc_tensor_sync_to_an_engine_on_the_same_gpu(tiny_model_dir):
    # colocated: trainer and engine share cuda:0; the engine maps the trainer's tensors by IPC handle
    metrics = synced_with_check(tiny_model_dir, "tensor", {"CUDA_VISIBLE_DEVICES": "0"})
    assert metrics["sync/version"] == 1 and metrics["sync/check_max_abs_diff"] < 1e-3


def test_memory_release_frees_device_memory_and_resume_generates_the_same(tiny_model_dir):
    from verst.engine.process import EngineProcess
    from verst.inference_client.client import EngineClient

    prompts = [[257 + (i % 3), *range(40 + i, 140 + i)] for i in range(32)]
    params = {"temperature": 1.0, "max_new_tokens": 64, "ignore_eos": True}

    async def seeded(client):
        replies = await asyncio.gather(*(client.generate(p, {**params, "sampling_seed": i}) for i, p in enumerate(prompts)))
        return [r.output_ids for r in replies]

    async def go(url):
        async with EngineClient(url) as client:
            before = await seeded(client)
            held = (await client.get_server_info())["internal_states"][0]
            freed = (await client.release_memory_occupation())["freed_bytes"]
            released = (await client.get_server_info())["internal_states"][0]
            await client.resume_memory_occupation()
            return before, await seeded(client), held, freed, released

    with EngineProcess(tiny_model_dir, args=["--device", "cuda"]) as engine:
        before, after, held, freed, released = asyncio.run(go(engine.url))
    drop = held["device_memory_bytes"] - released["device_memory_bytes"]
    print(f"device memory {held['device_memory_bytes']} -> {released['device_memory_bytes']} bytes (freed {freed})")
    assert freed["weights"] > 0 and freed["kv_cache"] > 0
    # the KV storage sits in large blocks of its own, which go whole; the tiny model's weights are small tensors,
    # whose 2 MiB pool blocks go only once nothing else lives in them
    assert drop >= freed["kv_cache"] + freed["weights"] // 2
    assert after == before
