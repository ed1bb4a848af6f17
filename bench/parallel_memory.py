"""Per-rank memory of the FSDP2 trainer's layouts (1 rank, dp 2, tp 2, dp 2 x tp 2; "sp": with sequence
parallelism) on a SmolLM2-sized model:
the bytes of parameters, gradients and AdamW state each rank holds (its local shards), its peak RSS, and the
train step's time (CPU, gloo, float32; time is reported, not a target). Ranks run as processes on this machine.

    .venv/bin/python bench/parallel_memory.py [--model smollm2-135m-8-heads-shape] [--layouts 1x1,2x1,1x2,2x2,1x2sp]

`--model smollm2-135m-8-heads-vocab-shape`: the same body at SmolLM2's 49,152-token vocabulary, tied embeddings
(the vocabulary-parallel embedding and head at tp > 1).
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from _memory import peak_rss_mib  # noqa: E402
from _models import resolve_model  # noqa: E402
from train_throughput import make_batch  # noqa: E402

from verst.config.schema import ModelConfig, TrainerConfig  # noqa: E402
from verst.trainer import sft_loss_fn  # noqa: E402


def local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _rank(rank: int, world: int, tp: int, sequence_parallel: bool, port: int, model_path: str, batch: int, steps: int,
          out: str) -> None:
    import torch.distributed as dist

    from verst.trainer import FSDP2Backend
    from verst.trainer.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port, torch.device("cpu"), timeout_s=1800)
    try:
        config = TrainerConfig(lr=1e-5, max_tokens_per_micro_batch=1024, tensor_parallel_size=tp,
                               sequence_parallel=sequence_parallel)
        backend = FSDP2Backend(ModelConfig(path=model_path), config, device="cpu")
        items = make_batch(batch, seed=0, vocab=backend.model.config.vocab_size)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            backend.train_step(items, sft_loss_fn)
            times.append(time.perf_counter() - start)
        params = list(backend.model.parameters())
        state = [t for s in backend.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        row = {"rank": rank, "params": local_bytes(params), "grads": local_bytes(p.grad for p in params
                                                                                  if p.grad is not None),
               "optimizer": local_bytes(state), "rss": peak_rss_mib(), "step_s": sorted(times)[len(times) // 2],
               "n_params": sum(p.numel() for p in params)}
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(row, f)
    finally:
        dist.destroy_process_group()


def run_layout(dp: int, tp: int, sequence_parallel: bool, model_path: Path, batch: int, steps: int,
               tmp: Path) -> list[dict]:
    world = dp * tp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"dp{dp}-tp{tp}-sp{sequence_parallel:d}"
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank, args=(r, world, tp, sequence_parallel, port, str(model_path), batch,
                                                         steps, str(out)))
             for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"layout dp {dp} x tp {tp}: rank exit codes {[p.exitcode for p in procs]}")
    return [pickle.loads(Path(f"{out}.{r}").read_bytes()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-8-heads-shape")
    parser.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="dp x tp[sp], comma-separated (1x2sp: tp 2 "
                        "with sequence parallelism)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout")
    args = parser.parse_args()
    model_path = resolve_model(args.model)
    print(f"model {args.model}; per rank: local shards of parameters, gradients and AdamW state (MiB), peak RSS")
    print("| layout | ranks | parameters | gradients | AdamW state | peak RSS | step (s) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            sequence_parallel = layout.endswith("sp")
            dp, tp = (int(x) for x in layout.removesuffix("sp").split("x"))
            rows = run_layout(dp, tp, sequence_parallel, model_path, args.batch, args.steps, Path(tmp))
            mib = lambda key: max(r[key] for r in rows) / 2**20  # noqa: E731
            print(f"| dp {dp} x tp {tp}{', sp' if sequence_parallel else ''} | {dp * tp} | {mib('params'):.0f} | {mib('grads'):.0f} | "
                  f"{mib('optimizer'):.0f} | {max(r['rss'] for r in rows):.0f} | "
                  f"{max(r['step_s'] for r in rows):.1f} |", flush=True)


if __name__ == "__main__":
    main()
