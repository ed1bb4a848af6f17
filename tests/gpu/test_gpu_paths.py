"""The GPU paths verst is written for but cannot run on the CPU machines: FSDP2 with bf16 mixed
precision over NCCL, the embedded engine on CUDA, and the NCCL weight broadcast. Run with
`make test-gpu` on a machine with a CUDA GPU; skipped elsewhere (and deselected by default)."""

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


def test_nccl_weight_sync_to_cuda_engine(tiny_model_dir):
    from verst.config import ModelConfig, SyncConfig, TrainerConfig
    from verst.engine.process import EngineProcess
    from verst.inference_client.fleet import EngineFleet
    from verst.sync import build_syncer
    from verst.trainer import FSDP2Backend, sft_loss_fn

    trainer = FSDP2Backend(ModelConfig(path=str(tiny_model_dir)), TrainerConfig(lr=1e-3), device="cuda")
    trainer.train_step(make_samples(), sft_loss_fn)
    with EngineProcess(tiny_model_dir, args=["--device", "cuda", "--weight-version", "0"]) as engine:
        async def go():
            async with EngineFleet([engine.url]) as fleet:
                syncer = build_syncer(SyncConfig(transport="distributed", check_weights=True), fleet,
                                      logprobs_fn=trainer.logprobs, device="cuda")
                try:
                    return await syncer.sync(list(trainer.named_weights(1 << 28)), 1)
                finally:
                    await syncer.close()

        metrics = asyncio.run(go())
    assert metrics["sync/version"] == 1 and metrics["sync/check_max_abs_diff"] < 1e-3
