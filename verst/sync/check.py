"""The weight check (`sync.check_weights`): after a sync, every engine must serve the trainer's weights.

Engines expose no weights or checksums yet, so the check goes through generation: each engine samples a
few probe prompts and the trainer recomputes the logprobs of exactly those tokens; equal weights agree
to float noise (float32 CPU: 1e-4). A mismatch names the engine, probe and token; it cannot name the
tensor until engines serve per-tensor checksums.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from verst.inference_client.client import GenerateResult
from verst.inference_client.fleet import EngineFleet
from verst.types import Sample

# The trainer's forward-only logprobs of each sample's response tokens.
LogprobsFn = Callable[[list[Sample]], list[torch.Tensor]]


class WeightCheckError(RuntimeError):
    """An engine does not serve the trainer's weights; `mismatches` maps each engine URL to the detail."""

    def __init__(self, version: int, mismatches: dict[str, str]):
        lines = "; ".join(f"{url}: {detail}" for url, detail in mismatches.items())
        super().__init__(
            f"weight check after the sync to version {version} failed on {len(mismatches)} engine(s): {lines}. "
            "(Logprob probes cannot name the tensor: that needs a per-tensor checksum endpoint on the engine.)"
        )
        self.version, self.mismatches = version, mismatches


def default_probes(vocab_size: int, count: int = 3, length: int = 12, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` token ids spread over the whole vocabulary (fixed by `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


class LogprobChecker:
    """`logprobs_fn(items)` is the trainer's forward-only logprobs (`FSDP2Backend.logprobs`,
    `TrainerActorGroup.logprobs`); `temperature` must be the one it divides logits by, and the engines
    sample the probes at it, so both sides report the same distribution. `lora_path`: the adapter the
    probes name (a LoRA run's policy adapter), so the engines sample base + adapter as the trainer computes.
    `routed_experts_top_k` (an MoE policy under `algorithm.routing_replay`): the engines return the experts each
    probe token was routed to, and the trainer's forward replays them, as for a rollout's samples.
    """

    def __init__(
        self, logprobs_fn: LogprobsFn, *, temperature: float = 1.0, probes: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int = 8, atol: float = 1e-4, seed: int = 1234, lora_path: str | None = None,
        routed_experts_top_k: int | None = None,
    ):
        if temperature <= 0:
            raise ValueError(f"weight check temperature must be > 0 (the trainer's logprob temperature), got {temperature}")
        self.logprobs_fn, self.temperature, self.atol = logprobs_fn, temperature, atol
        self.probes = [list(p) for p in probes] if probes is not None else None
        self.max_new_tokens, self.seed, self.lora_path = max_new_tokens, seed, lora_path
        self.routed_experts_top_k = routed_experts_top_k

    async def check(self, fleet: EngineFleet, version: int) -> dict[str, float]:
        """Raises `WeightCheckError` naming every engine that differs; returns `sync/check_*` metrics."""
        start = time.perf_counter()
        probes = self.probes or default_probes(await _vocab_size(fleet))
        replies = await fleet.each("weight check probe", lambda c: self._sample(c, probes))
        samples, owners = [], []
        for url, results in replies.items():
            for p, (prompt, result) in enumerate(zip(probes, results)):
                n = len(result.output_ids)
                samples.append(Sample(tokens=prompt + result.output_ids, response_length=n, loss_mask=[1] * n,
                                      rollout_logprobs=result.logprobs or [0.0] * n, index=len(samples),
                                      routed_experts=self._experts(url, p, result)))
                owners.append((url, p, result))
        want = await asyncio.to_thread(self.logprobs_fn, samples)
        mismatches: dict[str, str] = {}
        worst = 0.0
        for (url, p, result), expected in zip(owners, want):
            if url in mismatches:
                continue
            detail, diff = self._compare(p, result, expected, version)
            worst = max(worst, diff)
            if detail:
                mismatches[url] = detail
        if mismatches:
            raise WeightCheckError(version, mismatches)
        return {"sync/check_seconds": time.perf_counter() - start, "sync/check_max_abs_diff": worst}

    async def _sample(self, client: Any, probes: list[list[int]]) -> list[GenerateResult]:
        params = lambda i: {"temperature": self.temperature, "max_new_tokens": self.max_new_tokens,  # noqa: E731
                            "ignore_eos": True, "sampling_seed": self.seed + i}
        experts = self.routed_experts_top_k is not None
        return list(await asyncio.gather(*(client.generate(p, params(i), return_logprob=True, lora_path=self.lora_path,
                                                           return_routed_experts=experts)
                                           for i, p in enumerate(probes))))

    def _experts(self, url: str, p: int, result: GenerateResult) -> list[list[list[int]]] | None:
        """The experts the engine routed probe `p`'s tokens to, for the trainer to replay (None: not an MoE
        replay run)."""
        if self.routed_experts_top_k is None:
            return None
        experts = result.routed_experts(self.routed_experts_top_k)
        if experts is None:
            raise ValueError(f"weight check: {url} answered probe {p} without routed_experts; "
                             "algorithm.routing_replay replays the engine's routing in the trainer's forward")
        return experts.tolist()

    def _compare(self, p: int, result: GenerateResult, expected: torch.Tensor, version: int) -> tuple[str, float]:
        if result.weight_version != str(version):
            return f"probe {p} was served by weight_version {result.weight_version!r}, not {version}", 0.0
        if result.logprobs is None or not result.output_ids:
            return f"probe {p} returned no tokens or logprobs (finish_reason {result.finish_reason!r})", 0.0
        got = torch.tensor(result.logprobs, dtype=torch.float32)  # [response]
        diff = (got - expected.float()).abs()  # [response]
        j = int(diff.argmax())
        if diff[j] > self.atol:
            return (f"probe {p} token {j} (id {result.output_ids[j]}): engine logprob {got[j]:.6f} vs trainer "
                    f"{expected[j]:.6f} (|diff| {diff[j]:.2e} > atol {self.atol:g})"), float(diff[j])
        return "", float(diff[j])


async def _vocab_size(fleet: EngineFleet) -> int:
    """From the engine's model info (verst engines), else from the config.json of the checkpoint it names
    (SGLang's model info carries no vocabulary size)."""
    url = fleet.urls[0]
    info = await fleet.clients[url].get_model_info()
    if isinstance(info.get("vocab_size"), int):
        return info["vocab_size"]
    config = Path(str(info.get("model_path"))) / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["vocab_size"])
    raise ValueError(f"{url}/get_model_info has no vocab_size ({sorted(info)}) and names no readable checkpoint "
                     f"({config}); pass probes= to LogprobChecker")
