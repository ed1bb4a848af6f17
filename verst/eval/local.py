"""Score a Hugging Face snapshot of a run's weights with an embedded engine of its own: a child process on
127.0.0.1 serving the snapshot as weight version `step`, the run's held-out prompts, then stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.data import held_out_prompts
from verst.eval.agentic import evaluate_agentic
from verst.eval.engine import engine_greedy_generate
from verst.eval.greedy import evaluate_greedy
from verst.inference_client.client import EngineClient

SERVE_ENGINE = ["-m", "verst.cli.main", "serve", "engine"]  # `verst serve engine`, with this interpreter


@contextlib.contextmanager
def serve_snapshot(snapshot: str | Path, step: int, *, device: str = "cpu", model_impl: str = "auto",
                   log_path: str | Path | None = None, startup_timeout: float = 300.0) -> Iterator[str]:
    """`verst serve engine` on a free port of 127.0.0.1 serving `snapshot` as weight version `step`; yields
    its URL and stops it on exit."""
    from verst.engine.process import EngineProcess

    if device == "auto":  # cluster.device's default
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    args = ["--weight-version", str(step), "--device", device, "--model-impl", model_impl]
    with EngineProcess(snapshot, args=args, entry=SERVE_ENGINE, log_path=log_path,
                       startup_timeout=startup_timeout) as engine:
        yield engine.url


@functools.lru_cache(maxsize=4)
def run_tokenizer(path: str) -> Any:
    """The tokenizer of a run's model, loaded once per process (every evaluation of the run uses it)."""
    from verst.models import load_tokenizer

    return load_tokenizer(path)


async def score_engines(cfg: VerstConfig, url: str, tokenizer: Any, prompts: list, version: int, *,
                        max_batch: int = 1, lora_path: str | None = None) -> dict[str, float]:
    """The run's held-out score (greedy accuracy, or agent success) through the engine or router at `url`,
    every reply of which must come from weight version `version`; `lora_path` names the adapter scored."""
    if cfg.rollout.agent_fn:  # a tool-using task: the first reply is a tool call, so run whole episodes
        async with EngineClient(url, affinity=True, lora_path=lora_path) as client:
            return await evaluate_agentic(cfg, client, tokenizer, prompts, expect_version=str(version))
    max_new = cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens
    generate = engine_greedy_generate(url, max_new, expect_version=str(version), max_batch=max_batch,
                                      lora_path=lora_path)
    metrics = await asyncio.to_thread(evaluate_greedy, prompts, generate, tokenizer, cfg.reward, cfg.data, max_new)
    # every reply carried `version` (else MixedVersionError): the mean is it, none mixed
    return metrics | {"eval/weight_version": float(version), "eval/mixed_version_ratio": 0.0}


def score_url(cfg: VerstConfig, url: str, tokenizer: Any, prompts: list, version: int) -> dict[str, float]:
    """`score_engines` from a thread without an event loop (the evaluation fleet's and a snapshot's)."""
    return asyncio.run(score_engines(cfg, url, tokenizer, prompts, version))


def score_snapshot(cfg: VerstConfig, snapshot: str | Path, step: int, *, dataset: str | None = None,
                   log_path: str | Path | None = None) -> dict[str, float]:
    """`eval/` metrics of the snapshot of step `step`, scored by an engine process of its own."""
    from verst.models import load_tokenizer

    tokenizer, prompts = load_tokenizer(str(snapshot)), held_out_prompts(cfg, dataset)
    with serve_snapshot(snapshot, step, model_impl=cfg.model.impl, log_path=log_path) as url:
        return score_url(cfg, url, tokenizer, prompts, step)
