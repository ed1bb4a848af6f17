"""Weight sync: seconds per sync of each transport (distributed / tensor / disk) for models of ~1M, ~10M
and ~100M parameters, each against its own bound measured in the same run on the same bytes: `tensor`
against one memcpy, `distributed` against one gloo broadcast of a preallocated flat buffer to as many
receiving processes as engines, `disk` against safetensors writing the file and reading it back into
preallocated tensors; each bound is measured just before its transport. Prints each ratio (medians, and
fastest against fastest, which a loaded machine disturbs less), the part of a sync outside the push (pause,
continue, and for `disk` the flush and version calls: the fixed cost), how much the engine's resident
memory grows during the syncs against one bucket, two memcpys run at once (the floor of `tensor`'s two
copies where memory bandwidth bounds a copy), and the load average. With `--lora-rank R`, also LoRA's adapter sync (`lora.sync = "adapter"`: rank-R adapters on every
linear layer, pushed alone and served by name) against the full-model sync (`lora.sync = "merged"` moves the
same bytes as a full-weight sync), per transport, in the same run.

A sync is the whole lifecycle (`WeightSyncer.sync`: pause, flush, push, set version, continue) from
this process, which holds the full float32 weights as a trainer's rank 0 would, to engines served by
`verst serve engine` in child processes. The first sync of each transport is a warm-up (the broadcast
group is built and the shared memory allocated then); the median of the next `--repeats` is reported.

    .venv/bin/python bench/weight_sync.py [--sizes 1M,10M,100M] [--engines 1] [--repeats 3]
        [--transports distributed,tensor,disk] [--bucket-mb 512] [--snapshot-dir DIR] [--lora-rank 8]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
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
from verst.inference_client.ports import free_port  # noqa: E402
from verst.inference_client.weights import open_weight_update_group  # noqa: E402
from verst.models.chat_template import TINY_CHAT_TEMPLATE  # noqa: E402
from verst.models.factory import count_parameters, model_config  # noqa: E402
from verst.models.tokenizer import save_tokenizer  # noqa: E402
from verst.sync import AdapterSpec, build_syncer  # noqa: E402
from verst.trainer.persistence import named_tensors  # noqa: E402

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


def memcpy_times(nbytes: int, repeats: int = 5) -> list[float]:
    """Times of one copy of `nbytes` between two preallocated buffers (the `tensor` transport's bound)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return times


def concurrent_memcpy_times(nbytes: int, repeats: int = 5) -> list[float]:
    """Times of two copies of `nbytes` at once, each in its own thread between its own buffers: what the
    `tensor` transport's two copies (into shared memory, out of it) cost when fully overlapped. Where one
    copy already takes the memory bandwidth, this is about two copies' time, whatever the cores."""
    import threading

    pairs = [(torch.randn(nbytes // 4), torch.empty(nbytes // 4)) for _ in range(2)]
    for src, dst in pairs:
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        threads = [threading.Thread(target=dst.copy_, args=(src,)) for src, dst in pairs]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        times.append(time.perf_counter() - start)
    return times


def _gloo_receiver(port: int, rank: int, world: int, nbytes: int, rounds: int) -> None:
    torch.set_num_threads(1)
    group = open_weight_update_group("127.0.0.1", port, rank, world, "bound", "gloo", 120.0)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        group.broadcast([buffer])


def gloo_times(nbytes: int, receivers: int, repeats: int = 3) -> list[float]:
    """Times of one gloo broadcast of `nbytes` from a preallocated buffer here into preallocated
    buffers of `receivers` other processes (the `distributed` transport's bound); one warm-up first."""
    port, world = free_port(), receivers + 1
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=_gloo_receiver, args=(port, rank, world, nbytes, repeats + 1), daemon=True)
             for rank in range(1, world)]
    for proc in procs:
        proc.start()
    group = open_weight_update_group("127.0.0.1", port, 0, world, "bound", "gloo", 120.0)
    buffer = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        group.broadcast([buffer])
        times.append(time.perf_counter() - start)
    for proc in procs:
        proc.join(60)
    return times[1:]


def safetensors_times(weights: list, directory: Path, repeats: int = 3) -> list[float]:
    """Times of writing the weights as a new safetensors file (`save_file`) and reading it back into
    preallocated tensors (`load_file`, then a copy each): the `disk` transport's bound. Each file is deleted
    after its timing, as the transport deletes old snapshots off the sync's path."""
    from safetensors.torch import load_file, save_file

    tensors = {name: tensor.contiguous() for name, tensor in weights}
    targets = {name: torch.empty_like(tensor) for name, tensor in tensors.items()}
    directory.mkdir(parents=True, exist_ok=True)
    times = []
    for i in range(repeats + 1):
        path = directory / f"bound-{i}.safetensors"
        start = time.perf_counter()
        save_file(tensors, str(path), metadata={"format": "pt"})
        for name, tensor in load_file(str(path)).items():
            targets[name].copy_(tensor)
        times.append(time.perf_counter() - start)
        path.unlink()
    return times[1:]


def rss_mib(pid: int, field: str) -> float:
    """`VmRSS` or `VmHWM` (peak since the last `reset_peak`) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # Linux: VmHWM restarts from VmRSS


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
    timed = runs[1:] or runs
    return {"seconds": statistics.median(r["sync/seconds"] for r in timed),
            "best": min(r["sync/seconds"] for r in timed),
            "push": statistics.median(r["sync/push_seconds"] for r in timed),
            "fixed": statistics.median(r["sync/seconds"] - r["sync/push_seconds"] for r in timed),
            "bytes": timed[0]["sync/bytes"]}


def bench_size(size: str, args: argparse.Namespace, root: Path) -> list[dict]:
    model, path = make_model(size, root / size)
    params = count_parameters(model)
    weights = [(name, tensor.detach()) for name, tensor in named_tensors(model)]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    snapshots = Path(args.snapshot_dir or root)
    # each bound is measured just before its transport, under the same load
    bounds = {"tensor": ("memcpy", lambda: memcpy_times(nbytes, args.repeats + 2)),
              "distributed": ("gloo broadcast", lambda: gloo_times(nbytes, args.engines, args.repeats)),
              "disk": ("safetensors write+read",
                       lambda: safetensors_times(weights, snapshots / f"bound-{size}", args.repeats))}
    engines = [EngineProcess(path, args=["--prefix-cache-tokens", "0"]).start(wait=False) for _ in range(args.engines)]
    rows = []
    try:
        for engine in engines:
            engine.wait_ready()
        urls = [engine.url for engine in engines]
        cfg = SyncConfig(bucket_bytes=args.bucket_mb * 2**20)
        bucket_mib = min(args.bucket_mb, nbytes / 2**20)
        # An engine starts with its weights mapped from the checkpoint; the first write into them makes them
        # private memory. One untimed sync does that, so no transport's memory growth includes it.
        asyncio.run(time_transport("disk", urls, weights, cfg, snapshots / f"first-{size}", path, 0))
        for transport in args.transports:
            bound_name, measure = bounds[transport]
            bound_times = measure()
            overlapped = concurrent_memcpy_times(nbytes, args.repeats + 2) if transport == "tensor" else [math.nan]
            pid = engines[0].proc.pid
            reset_peak(pid)
            before = rss_mib(pid, "VmRSS")
            result = asyncio.run(time_transport(transport, urls, weights, cfg, snapshots / f"snapshots-{size}", path,
                                                args.repeats))
            growth = rss_mib(pid, "VmHWM") - before
            assert result["bytes"] == nbytes
            bound, bound_best = statistics.median(bound_times), min(bound_times)
            rows.append({"size": size, "params": params, "bytes": nbytes, "transport": transport, **result,
                         "bound_name": bound_name, "bound": bound, "bound_best": bound_best, "rss_growth": growth,
                         "bucket_mib": bucket_mib, "two_copies": statistics.median(overlapped)})
            print(f"  {size:>5} {transport:<12} sync {result['seconds'] * 1e3:8.1f} ms (best {result['best'] * 1e3:.1f}) "
                  f"push {result['push'] * 1e3:8.1f} ms  = {result['seconds'] / bound:5.2f}x {bound_name} "
                  f"({bound * 1e3:.1f} ms, best {bound_best * 1e3:.1f}, for {nbytes / 2**20:.0f} MiB); engine RSS "
                  f"+{growth:.0f} MiB (bucket {bucket_mib:.0f} MiB)", flush=True)
        if args.lora_rank:
            rows += bench_adapter(size, model, path, urls, cfg, args, root, rows)
    finally:
        for engine in engines:
            engine.stop()
    return rows


def bench_adapter(size: str, model, path: Path, urls: list[str], cfg: SyncConfig, args: argparse.Namespace,
                  root: Path, full_rows: list[dict]) -> list[dict]:
    """Adapter sync of each transport against that transport's full-model sync (the merged sync's bytes)."""
    tensors, spec = lora_adapter(model, path, args.lora_rank)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    rows = []
    for transport in args.transports:
        snapshots = Path(args.snapshot_dir or root) / f"adapters-{size}"
        result = asyncio.run(time_transport(transport, urls, tensors, cfg, snapshots, path, args.repeats, spec))
        assert result["bytes"] == nbytes
        full = next(r for r in full_rows if r["size"] == size and r["transport"] == transport)
        rows.append({"size": size, "adapter": f"lora r{args.lora_rank}", "bytes": nbytes, "transport": transport,
                     "seconds": result["seconds"], "full_bytes": full["bytes"], "full_seconds": full["seconds"]})
        print(f"  {size:>5} {transport:<12} adapter sync {result['seconds'] * 1e3:8.1f} ms for "
              f"{nbytes / 2**20:.2f} MiB vs full {full['seconds'] * 1e3:8.1f} ms for {full['bytes'] / 2**20:.0f} MiB",
              flush=True)
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
          f"median of {args.repeats} syncs after a warm-up; load average {load_average()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="verst-bench-sync-") as tmp:
        for size in args.sizes:
            rows += bench_size(size, args, Path(tmp))
    print_summary([r for r in rows if "adapter" not in r], [r for r in rows if "adapter" in r])
    print(f"load average at the end {load_average()}")
    return 0


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def print_summary(rows: list[dict], lora_rows: list[dict]) -> None:
    print("\nsize   params      MiB  transport      sync ms  push ms  fixed ms  bound                   bound ms  "
          "ratio  best ratio  engine RSS +MiB  bucket MiB")
    for r in rows:
        print(f"{r['size']:<5} {r['params'] / 1e6:6.1f}M {r['bytes'] / 2**20:8.0f}  {r['transport']:<12} "
              f"{r['seconds'] * 1e3:9.1f} {r['push'] * 1e3:8.1f} {r['fixed'] * 1e3:9.1f}  {r['bound_name']:<22} "
              f"{r['bound'] * 1e3:9.1f} {r['seconds'] / r['bound']:6.2f}x {r['best'] / r['bound_best']:10.2f}x "
              f"{r['rss_growth']:16.0f} {r['bucket_mib']:11.0f}")
    print("(ratio = median seconds per sync / median seconds of the transport's bound on the same bytes; best ratio: "
          "the fastest sync / the fastest bound; fixed = sync - push: pause and continue, and for disk the flush and "
          "version calls, which the other transports' loads carry)")
    for r in rows:
        if r["transport"] == "tensor":
            print(f"{r['size']}: two memcpys at once (threads) take {r['two_copies'] * 1e3:.1f} ms = "
                  f"{r['two_copies'] / r['bound']:.2f}x one memcpy: the floor of the tensor transport's two copies")
    if lora_rows:
        print("\nsize   adapter     transport     adapter MiB  adapter ms   full MiB   full ms  full / adapter")
        for r in lora_rows:
            print(f"{r['size']:<5}  {r['adapter']:<10}  {r['transport']:<12} {r['bytes'] / 2**20:11.2f} "
                  f"{r['seconds'] * 1e3:11.1f} {r['full_bytes'] / 2**20:10.0f} {r['full_seconds'] * 1e3:9.1f} "
                  f"{r['full_seconds'] / r['seconds']:14.1f}x")


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    sys.exit(report_peaks(main))
