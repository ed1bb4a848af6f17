"""Generation throughput: the embedded engine (continuous batching) against Hugging Face `generate` in
static batches of the same size, on the same requests, in one run. Target: engine >= 2x HF generate on the
tiny models, >= 3x on a real one (`--model smollm2`: SmolLM2-135M-Instruct; or `--model PATH`, any HF
checkpoint directory, instead of `--sizes`).

256 requests with prompts of 16-48 tokens and long-tailed output lengths (4-128 tokens, log-normal);
`--samples-per-prompt 8` asks each prompt 8 times in a row, as GRPO does.
Every request generates exactly its length (EOS ignored), so both sides produce the same useful tokens;
a static batch runs until its longest request is done, as `generate` does. Temperature 1 sampling.
The engine is measured in-process (`EngineCore.step`), with its native forward (model_impl auto) and with
transformers' forward, and served over HTTP (`verst serve engine` in a
child process, 256 concurrent requests through the async client). Peak RSS of this process (which holds
the model for both in-process sides) and of the served engine. vLLM is not compared: verst has no vLLM
engine adapter, and the output says whether vllm is installed.

    .venv/bin/python bench/engine_throughput.py [--sizes tiny,small | --model smollm2|PATH] [--requests 256]
        [--batch 64] [--samples-per-prompt 8] [--no-http]
    # a GRPO step's generation on the real model: 8 prompts x 8 samples
    .venv/bin/python bench/engine_throughput.py --model smollm2 --requests 64 --batch 64 --samples-per-prompt 8
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
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
from _memory import peak_rss_mib  # noqa: E402
from _models import resolve_model  # noqa: E402

from verst.engine.core import EngineConfig, EngineCore  # noqa: E402
from verst.engine.process import EngineProcess  # noqa: E402
from verst.engine.request import Request  # noqa: E402
from verst.inference_client.client import EngineClient  # noqa: E402
from verst.inference_client.protocol import SamplingParams  # noqa: E402
from verst.models.factory import init_model  # noqa: E402
from verst.models.loader import load_model_and_tokenizer  # noqa: E402


def workload(n: int, seed: int, per_prompt: int = 1, ids: list[int] | range = range(256)) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: prompts of 16-48 random `ids`, each asked `per_prompt` times in a
    row (a GRPO group), outputs log-normal (median 16) in [4, 128]."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        prompt = [rng.choice(ids) for _ in range(rng.randint(16, 48))]
        for _ in range(min(per_prompt, n - len(out))):
            out.append((prompt, min(128, max(4, round(math.exp(rng.gauss(math.log(16), 0.9)))))))
    return out


def run_hf(model, work, batch: int, seed: int, pad: int = 0) -> tuple[float, int]:
    """Static batches of `batch` requests, left-padded; each batch generates its longest length."""
    torch.manual_seed(seed)
    useful, start = 0, time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(n for _, n in chunk)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                                 pad_token_id=pad)
        assert out.shape[1] == width + longest
        useful += sum(n for _, n in chunk)  # tokens past a request's own length are padding work
    return time.perf_counter() - start, useful


def run_engine(model, tokenizer, work, batch: int, seed: int, impl: str = "auto") -> tuple[float, int, int]:
    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=batch, seed=seed, model_impl=impl))
    reqs = [Request(rid=str(i), prompt_ids=p, return_logprob=True,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(work)]
    start = time.perf_counter()
    for r in reqs:
        core.add_request(r)
    while core.has_work():
        core.step()
    elapsed = time.perf_counter() - start
    produced = sum(len(r.output_ids) for r in reqs)
    assert produced == sum(n for _, n in work), "engine produced a different number of tokens"
    return elapsed, produced, core.counters["steps"]


async def _http_requests(url: str, work) -> int:
    async with EngineClient(url) as client:
        results = await asyncio.gather(*(client.generate(p, {"max_new_tokens": n, "ignore_eos": True})
                                         for p, n in work))
    return sum(len(r.output_ids) for r in results)


def run_http(path: Path, work, batch: int) -> tuple[float, int, float]:
    with EngineProcess(path, args=["--max-running-requests", str(batch)]) as engine:
        asyncio.run(_http_requests(engine.url, work[:8]))  # warm-up
        start = time.perf_counter()
        produced = asyncio.run(_http_requests(engine.url, work))
        elapsed = time.perf_counter() - start
        rss = peak_rss_mib(engine.proc.pid)
    return elapsed, produced, rss


def bench_model(path: Path, name: str, args) -> None:
    model, tokenizer = load_model_and_tokenizer(path)
    added = set(tokenizer.get_added_vocab().values())  # special and control tokens
    ids = [i for i in range(len(tokenizer)) if i not in added]  # the tiny models': the 256 bytes
    pad = tokenizer.pad_token_id or 0
    work = workload(args.requests, args.seed, args.samples_per_prompt, ids)
    total = sum(n for _, n in work)
    warm = workload(args.batch, args.seed + 1, ids=ids)[: max(args.batch // 4, 1)]
    run_hf(model, warm, len(warm), args.seed, pad)
    run_engine(model, tokenizer, warm, len(warm), args.seed)
    hf_s, hf_tokens = run_hf(model, work, args.batch, args.seed, pad)
    eng_s, eng_tokens, steps = run_engine(model, tokenizer, work, args.batch, args.seed)
    tf_s, tf_tokens, _ = run_engine(model, tokenizer, work, args.batch, args.seed, impl="transformers")
    hf_tps, eng_tps = hf_tokens / hf_s, eng_tokens / eng_s
    print(f"\n== {name}: {args.requests} requests ({args.samples_per_prompt} per prompt), {total} output "
          f"tokens (lengths 4-128, mean {total / len(work):.1f}), batch {args.batch}")
    print(f"HF generate (static batches)   {hf_tps:8.1f} tok/s   {hf_s:6.2f} s")
    print(f"engine, in-process             {eng_tps:8.1f} tok/s   {eng_s:6.2f} s   {steps} steps")
    print(f"  same, transformers' forward  {tf_tokens / tf_s:8.1f} tok/s   {tf_s:6.2f} s   "
          f"native / transformers {eng_tps / (tf_tokens / tf_s):.2f}x")
    print(f"ratio engine / HF              {eng_tps / hf_tps:8.2f}x   (target >= {args.target:g}x)")
    print(f"bench process peak RSS         {peak_rss_mib():8.1f} MiB   (the model, both in-process sides)")
    if not args.no_http:
        http_s, http_tokens, rss = run_http(path, work, args.batch)
        print(f"engine over HTTP (child)       {http_tokens / http_s:8.1f} tok/s   {http_s:6.2f} s   "
              f"ratio {http_tokens / http_s / hf_tps:.2f}x   engine server peak RSS {rss:.1f} MiB")
    vllm = "installed" if importlib.util.find_spec("vllm") else "not installed"
    print(f"vLLM-CPU                       not measured: verst has no vLLM engine adapter (vllm {vllm})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,small", help="seeded tiny models (verst model init --size)")
    p.add_argument("--model", help="instead of --sizes: smollm2 (SmolLM2-135M-Instruct) or a checkpoint directory")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="engine max running requests = HF static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="requests per distinct prompt, sent together (8: a GRPO group; the engine prefills it once)")
    p.add_argument("--no-http", action="store_true", help="skip the served (child process) measurement")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.target = 3.0 if args.model else 2.0
    if args.model:
        path = resolve_model(args.model)
        bench_model(path, f"{args.model} ({path})", args)
        return
    with tempfile.TemporaryDirectory(prefix="verst-bench-") as tmp:
        for size in args.sizes.split(","):
            path = init_model("qwen3", size.strip(), Path(tmp) / f"qwen3-{size.strip()}", seed=0)
            bench_model(path, f"qwen3-{size.strip()}", args)


if __name__ == "__main__":
    main()
