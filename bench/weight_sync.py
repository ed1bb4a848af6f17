"""Weight sync: seconds per sync of each transport (distributed / tensor / disk) for models of ~1M, ~10M
and ~100M parameters, against the memcpy bound (one in-memory copy of the same bytes) measured in the
same run; prints the ratios. With `--lora-rank R`, also LoRA's adapter sync (`lora.sync = "adapter"`:
rank-R adapters on every linear layer, pushed alone and served by name) against the full-model sync
(`lora.sync = "merged"` moves the same bytes as a full-weight sync), per transport, in the same run.

A sync is the whole lifecycle (`WeightSyncer.sync`: pause, flush, push, set version, continue) from
this process, which holds the full float32 weights as a trainer's rank 0 would, to engines served by
`verst serve engine` in child processes. The first sync of each transport is a warm-up (the broadcast
group is built then); the median of the next `--repeats` is reported.

    .venv/bin/python bench/weight_sync.py [--sizes 1M,10M,100M] [--engines 1] [--repeats 3]
        [--transports distributed,tensor,disk] [--bucket-mb 512] [--snapshot-dir DIR] [--lora-rank 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from verst.config.schema import SyncConfig  # noqa: E402
from verst.engine.process import EngineProcess  # noqa: E402
from verst.inference_client.fleet import EngineFleet  # noqa: E402
from verst.models.chat_template import TINY_CHAT_TEMPLATE  # noqa: E402
from verst.models.factory import count_parameters, model_config  # noqa: E402
from verst.models.tokenizer import save_tokenizer  # noqa: E402
from verst.sync import AdapterSpec, build_syncer  # noqa: E402
from verst.trainer.checkpoint import named_tensors  # noqa: E402

# Qwen3 shapes giving ~1M, ~10M and ~100M parameters with the tiny byte-level vocabulary.
SIZES = {
    "1M": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 512},
    "10M": {"hidden_size": 384, "num_hidden_layers": 5, "num_attention_heads": 6, "num_key_value_heads": 2,
            "intermediate_size": 1536},
    "100M": {"hidden_size": 1024, "num_hidden_layers": 7, "num_attention_heads": 16, "num_key_value_heads": 4,
             "intermediate_size": 3584},
}
TRANSPORTS = ("distributed", "tensor", "disk")


def make_model(size: str, out: Path) -> tuple[torch.nn.Module, Path]:
    """A randomly initialised Qwen3 of `size`, saved with the tiny tokenizer so an engine can serve it."""
    from transformers import AutoModelForCausalLM

    base = model_config("qwen3", "tiny")
    fields = {k: v for k, v in base.to_dict().items() if k not in ("layer_types", "model_type", "transformers_version")}
    dims = SIZES[size]
    config = type(base)(**{**fields, **dims, "head_dim": dims["hidden_size"] // dims["num_attention_heads"]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    save_tokenizer(out, TINY_CHAT_TEMPLATE)
    return model, out


def memcpy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Median time of one copy of `nbytes` between two preallocated buffers (the bound for any transport)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lora_adapter(model: torch.nn.Module, source: Path, rank: int) -> tuple[list, AdapterSpec]:
    """Rank-`rank` PEFT adapters (random, non-zero) on every linear layer of `model` (changed in place):
    the tensors and spec an adapter sync pushes, under PEFT's names."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from verst.trainer.lora import adapter_config

    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                  init_lora_weights=False))
    tensors = [(name, tensor.detach().contiguous()) for name, tensor in get_peft_model_state_dict(peft_model).items()]
    return tensors, AdapterSpec("policy", adapter_config(peft_model, str(source)))


async def time_transport(transport: str, urls: list[str], weights, cfg: SyncConfig, snapshot_dir: Path,
                         source: Path, repeats: int, adapter: AdapterSpec | None = None) -> dict[str, float]:
    async with EngineFleet(urls) as fleet:
        syncer = build_syncer(cfg.model_copy(update={"transport": transport}), fleet, snapshot_dir=snapshot_dir,
                              source_model=source, adapter=adapter)
        version = await syncer.current_version()
        runs = []
        for _ in range(repeats + 1):
            version += 1
            runs.append(await syncer.sync([weights], version))
        await syncer.close()
    timed = runs[1:]
    return {"seconds": statistics.median(r["sync/seconds"] for r in timed),
            "push": statistics.median(r["sync/push_seconds"] for r in timed), "bytes": timed[0]["sync/bytes"]}


def bench_size(size: str, args: argparse.Namespace, root: Path) -> list[tuple]:
    model, path = make_model(size, root / size)
    params = count_parameters(model)
    weights = [(name, tensor.detach()) for name, tensor in named_tensors(model)]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    bound = memcpy_seconds(nbytes)
    engines = [EngineProcess(path, args=["--prefix-cache-tokens", "0"]).start(wait=False) for _ in range(args.engines)]
    rows = []
    try:
        for engine in engines:
            engine.wait_ready()
        urls = [engine.url for engine in engines]
        cfg = SyncConfig(bucket_bytes=args.bucket_mb * 2**20)
        for transport in args.transports:
            snapshots = Path(args.snapshot_dir or root) / f"snapshots-{size}"
            result = asyncio.run(time_transport(transport, urls, weights, cfg, snapshots, path, args.repeats))
            assert result["bytes"] == nbytes
            rows.append((size, params, nbytes, bound, transport, result["seconds"], result["push"]))
            print(f"  {size:>5} {transport:<12} sync {result['seconds'] * 1e3:8.1f} ms  push "
                  f"{result['push'] * 1e3:8.1f} ms  = {result['seconds'] / bound:6.1f}x memcpy "
                  f"({bound * 1e3:.1f} ms for {nbytes / 2**20:.0f} MiB)", flush=True)
        if args.lora_rank:
            rows += bench_adapter(size, model, path, urls, cfg, args, root, rows)
    finally:
        for engine in engines:
            engine.stop()
    return rows


def bench_adapter(size: str, model, path: Path, urls: list[str], cfg: SyncConfig, args: argparse.Namespace,
                  root: Path, full_rows: list[tuple]) -> list[tuple]:
    """Adapter sync of each transport against that transport's full-model sync (the merged sync's bytes)."""
    tensors, spec = lora_adapter(model, path, args.lora_rank)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    rows = []
    for transport in args.transports:
        snapshots = Path(args.snapshot_dir or root) / f"adapters-{size}"
        result = asyncio.run(time_transport(transport, urls, tensors, cfg, snapshots, path, args.repeats, spec))
        assert result["bytes"] == nbytes
        full = next(r for r in full_rows if r[0] == size and r[4] == transport)
        rows.append((size, f"lora r{args.lora_rank}", nbytes, transport, result["seconds"], full[2], full[5]))
        print(f"  {size:>5} {transport:<12} adapter sync {result['seconds'] * 1e3:8.1f} ms for "
              f"{nbytes / 2**20:.2f} MiB vs full {full[5] * 1e3:8.1f} ms for {full[2] / 2**20:.0f} MiB", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,10M,100M", help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--engines", type=int, default=1, help="engines receiving every sync")
    p.add_argument("--repeats", type=int, default=3, help="timed syncs per transport (after one warm-up)")
    p.add_argument("--bucket-mb", type=int, default=512, help="sync.bucket_bytes in MiB")
    p.add_argument("--snapshot-dir", default=None, help="where the disk transport writes (default: a temp dir)")
    p.add_argument("--lora-rank", type=int, default=0, help="also time LoRA adapter sync at this rank (0: no)")
    args = p.parse_args(argv)
    args.sizes = args.sizes.split(",")
    args.transports = args.transports.split(",")
    for size in args.sizes:
        if size not in SIZES:
            p.error(f"--sizes: {size!r} is not one of {', '.join(SIZES)}")
    for transport in args.transports:
        if transport not in TRANSPORTS:
            p.error(f"--transports: {transport!r} is not one of {', '.join(TRANSPORTS)}")
    torch.set_num_threads(1)
    print(f"weight sync to {args.engines} engine(s), float32, bucket {args.bucket_mb} MiB, "
          f"median of {args.repeats} syncs after a warm-up")
    rows = []
    with tempfile.TemporaryDirectory(prefix="verst-bench-sync-") as tmp:
        for size in args.sizes:
            rows += bench_size(size, args, Path(tmp))
    lora_rows = [r for r in rows if isinstance(r[1], str)]
    rows = [r for r in rows if not isinstance(r[1], str)]
    print("\nsize   params      MiB  memcpy ms  " + "  ".join(f"{t:>16}" for t in args.transports))
    for size in args.sizes:
        mine = [r for r in rows if r[0] == size]
        _, params, nbytes, bound, *_ = mine[0]
        cells = "  ".join(f"{r[5] * 1e3:7.1f} ms {r[5] / bound:5.1f}x" for r in mine)
        print(f"{size:<5} {params / 1e6:6.1f}M {nbytes / 2**20:8.0f}  {bound * 1e3:9.2f}  {cells}")
    print("(ratio = seconds per sync / seconds of one memcpy of the same bytes)")
    if lora_rows:
        print("\nsize   adapter     transport     adapter MiB  adapter ms   full MiB   full ms  full / adapter")
        for size, name, nbytes, transport, seconds, full_bytes, full_seconds in lora_rows:
            print(f"{size:<5}  {name:<10}  {transport:<12} {nbytes / 2**20:11.2f} {seconds * 1e3:11.1f} "
                  f"{full_bytes / 2**20:10.0f} {full_seconds * 1e3:9.1f} {full_seconds / seconds:14.1f}x")
    return 0


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    sys.exit(report_peaks(main))
