"""What `algorithm.true_on_policy` costs, on each side, measured in one run on the same requests:

- engine: generated tokens/s of an in-process `EngineCore` (native forward, CPU float32), plain against
  true on-policy (each finished request scored again by the trainer's forward over its whole sequence);
- trainer: one `FSDP2Backend.train_step` over the generated batch, micro-batches packed under the token
  budget (padded rows) against one unpadded sequence per micro-batch (`per_sequence`).

Prints each side's numbers and the ratio true-on-policy / plain (throughput) and plain / true-on-policy
(step time inverted, so both ratios read as "fraction of the plain speed kept"). It also checks the mode's
point: the engine's logprobs equal the per-sequence trainer's bit for bit.

    .venv/bin/python bench/true_on_policy.py [--model tiny|small|smollm2|PATH] [--requests 64]
        [--max-new-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from _models import KNOWN, resolve_model  # noqa: E402

from verst.config.schema import ModelConfig, TrainerConfig  # noqa: E402
from verst.engine.core import EngineConfig, EngineCore  # noqa: E402
from verst.engine.request import Request  # noqa: E402
from verst.inference_client.protocol import SamplingParams  # noqa: E402
from verst.models.factory import init_model  # noqa: E402
from verst.models.loader import load_tokenizer  # noqa: E402
from verst.models.native import load_causal_lm  # noqa: E402
from verst.trainer import FSDP2Backend, TrainItem, sft_loss_fn  # noqa: E402

TEMPERATURE = 1.0


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def generate(path: Path, true_on_policy: bool, batch: list[list[int]], max_new: int) -> tuple[float, list[Request]]:
    """Generated tokens/s of one engine over `batch` (every request runs to `max_new` tokens)."""
    engine = EngineCore(load_causal_lm(path), load_tokenizer(path), EngineConfig(seed=0, true_on_policy=true_on_policy))
    requests = [Request(f"r{i}", p, SamplingParams(temperature=TEMPERATURE, max_new_tokens=max_new, ignore_eos=True,
                                                   sampling_seed=i), return_logprob=True) for i, p in enumerate(batch)]
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return len(batch) * max_new / (time.perf_counter() - start), requests


def step_time(path: Path, per_sequence: bool, items: list[TrainItem], repeats: int) -> tuple[float, list[torch.Tensor]]:
    """Median seconds of one train step over `items`, and the logprobs of the first forward."""
    backend = FSDP2Backend(ModelConfig(path=str(path)), TrainerConfig(lr=1e-5, max_tokens_per_micro_batch=4096),
                           temperature=TEMPERATURE, device="cpu", per_sequence=per_sequence)
    logprobs = backend.logprobs(items)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.train_step(items, sft_loss_fn)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help=f"tiny, small, {', '.join(KNOWN)} or a checkpoint directory")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model in ("tiny", "small"):
        path = init_model("qwen3", args.model, Path(tempfile.mkdtemp()) / args.model, seed=0)
    else:
        path = resolve_model(args.model)
    vocab = int(load_causal_lm(path).get_input_embeddings().num_embeddings)
    batch = prompts(args.requests, vocab)
    torch.set_num_threads(1)
    rates = {}
    for mode in (False, True, False, True):  # interleaved: both modes see the same machine load
        rate, requests = generate(path, mode, batch, args.max_new_tokens)
        rates.setdefault(mode, []).append(rate)
        if mode:
            scored = requests
    items = [TrainItem(r.prompt_ids + r.output_ids, len(r.output_ids), torch.ones(len(r.output_ids)),
                       {"rollout_logprobs": r.output_logprobs}, i) for i, r in enumerate(scored)]
    plain_s, _ = step_time(path, False, items, args.repeats)
    sequence_s, logprobs = step_time(path, True, items, args.repeats)
    exact = all(torch.equal(a, it.extras["rollout_logprobs"]) for a, it in zip(logprobs, items))
    plain, tight = max(rates[False]), max(rates[True])
    print(f"model {path.name}: {args.requests} requests x {args.max_new_tokens} tokens, prompts 16-48 tokens")
    print(f"engine  plain {plain:8.1f} tok/s   true on-policy {tight:8.1f} tok/s   ratio {tight / plain:.2f}")
    print(f"trainer plain {plain_s:8.3f} s/step  per-sequence  {sequence_s:8.3f} s/step  ratio {plain_s / sequence_s:.2f}")
    print(f"engine logprobs bitwise equal to the trainer's: {exact}")


if __name__ == "__main__":
    main()
