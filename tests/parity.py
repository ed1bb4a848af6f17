"""Test helpers for rollout vs trainer logprob parity: generate on an in-process engine, turn the requests
into train items carrying their rollout logprobs, and check the trainer's logprobs against them."""

import torch

from verst.engine.core import EngineCore
from verst.engine.request import Request
from verst.inference_client.protocol import SamplingParams
from verst.trainer import FSDP2Backend, TrainItem


def rollout(engine: EngineCore, version: str, prompts: list[list[int]], temperature: float,
            max_new_tokens: int = 10, lora_path: str | None = None) -> list[Request]:
    """One seeded sample of `max_new_tokens` (EOS ignored) per prompt, run to completion (on the loaded
    adapter `lora_path`, if given)."""
    requests = [
        Request(f"{version}-{i}", prompt, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                                         ignore_eos=True, sampling_seed=i), return_logprob=True,
                lora_path=lora_path)
        for i, prompt in enumerate(prompts)
    ]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return requests


def as_items(requests: list[Request]) -> list[TrainItem]:
    return [
        TrainItem(r.prompt_ids + r.output_ids, len(r.output_ids), torch.ones(len(r.output_ids)),
                  {"rollout_logprobs": r.output_logprobs}, i)
        for i, r in enumerate(requests)
    ]


def assert_parity(backend: FSDP2Backend, requests: list[Request], atol: float = 1e-4) -> None:
    items = as_items(requests)
    for got, item in zip(backend.logprobs(items), items):
        torch.testing.assert_close(got, item.extras["rollout_logprobs"], atol=atol, rtol=0)
