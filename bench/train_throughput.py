"""Train-step throughput: verst's FSDP2 backend (1 rank, then 2 ranks) against a plain transformers +
AdamW loop on the same model and batch, measured in one run, and verst with activation checkpointing
(`trainer.gradient_checkpointing`). Target: verst overhead <= 15% on the tiny models, <= 5% on a real one
(`--model smollm2`: SmolLM2-135M-Instruct; or `--model PATH`, any HF checkpoint directory). Every variant gets
the same cores (`--cores N`, default all): one thread per core in one process, or half of them per rank,
each rank pinned to its half. Prints the peak RSS of this process (the plain loop and the 1-rank backends)
and of the 2-rank actors.

    .venv/bin/python bench/train_throughput.py [--arch qwen3] [--size small] [--steps 4] [--ranks 1,2]
    .venv/bin/python bench/train_throughput.py --model smollm2 --batch 16 --steps 3 --ranks 1
    # on a GPU: bfloat16 (verst's mixed precision; the plain loop under autocast with fused AdamW), with MFU
    python bench/train_throughput.py --device cuda --model qwen3-0.6b-shape --batch 64 --max-tokens 16384 --ranks 1
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from _cores import bench_cores, describe, pin_here  # noqa: E402
from _memory import PeakMemory, peak_rss_mib  # noqa: E402
from _models import resolve_model  # noqa: E402

from verst.config.schema import ClusterConfig, ModelConfig, TrainerConfig  # noqa: E402
from verst.engine.weights import safetensors_files, safetensors_shapes  # noqa: E402
from verst.models.factory import init_model  # noqa: E402
from verst.orchestration import Orchestration  # noqa: E402
from verst.run.cores import split_among  # noqa: E402
from verst.trainer import FSDP2Backend, TrainItem, sft_loss_fn  # noqa: E402


def make_batch(n: int, seed: int, vocab: int) -> list[TrainItem]:
    """RL-shaped sequences: prompts of 16-48 tokens, responses of 16-64, random ids."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        prompt, response = rng.randint(16, 48), rng.randint(16, 64)
        tokens = torch.tensor([rng.randrange(vocab) for _ in range(prompt + response)])
        items.append(TrainItem(tokens, response, torch.ones(response), index=i))
    return items


def plain_micro_batches(items: list[TrainItem], max_tokens: int) -> list[list[TrainItem]]:
    """The same token budget as verst (rows × longest ≤ max_tokens), longest first."""
    batches: list[list[TrainItem]] = []
    for item in sorted(items, key=lambda it: -it.length):
        if batches and (len(batches[-1]) + 1) * batches[-1][0].length <= max_tokens:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


# Dense bfloat16 peak FLOP/s by GPU name, for MFU (the vendors' sheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def plain_step(model, optimizer, micro_batches, total_tokens: int, grad_clip: float) -> None:
    """The baseline: padded rows with an attention mask, masked NLL, clip, AdamW (bfloat16 autocast on CUDA)."""
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    for batch in micro_batches:
        width = batch[0].length
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, it in enumerate(batch):
            ids[r, : it.length], mask[r, : it.length] = it.tokens, 1
            labels[r, it.prompt_length : it.length] = it.tokens[it.prompt_length :]
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        (nll / total_tokens).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()


def interleaved(fns: dict, steps: int) -> dict[str, tuple[float, float]]:
    """Median (wall s, CPU s) per call of each fn, after one warm-up call each.

    Calls alternate between the fns, so load from other processes on a shared machine hits all of
    them alike; CPU time of this process is the contention-free cross-check.
    """
    for fn in fns.values():
        fn()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            _synchronize()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            _synchronize()  # a CUDA step's kernels finish inside its time
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (_median([w for w, _ in s]), _median([c for _, c in s])) for name, s in samples.items()}


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def one_rank(path: Path, args, items: list[TrainItem]) -> dict[str, tuple[float, float]]:
    """The plain loop, verst's backend and verst's backend with activation checkpointing, interleaved."""
    from transformers import AutoModelForCausalLM

    policy_tokens = sum(it.response_length for it in items)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    micro = plain_micro_batches(items, args.max_tokens)
    model_cfg = ModelConfig(path=str(path), dtype="bfloat16" if args.device == "cuda" else "float32")
    backend = FSDP2Backend(model_cfg, trainer_config(args), device=args.device)
    fns = {"plain": lambda: plain_step(model, optimizer, micro, policy_tokens, 1.0),
           "verst": lambda: backend.train_step(items, sft_loss_fn)}
    if args.checkpointing:
        recompute = FSDP2Backend(model_cfg, trainer_config(args, gradient_checkpointing=True), device=args.device)
        fns["verst_ckpt"] = lambda: recompute.train_step(items, sft_loss_fn)
    return interleaved(fns, args.steps)


def two_ranks(path: Path, args, items: list[TrainItem]) -> tuple[tuple[float, float], dict[str, float]]:
    """Two rank actors on a local Ray, as `verst sft` starts them with cluster.trainer_ranks = 2: the same
    cores as the one-rank variants, split between the two ranks (each pinned to its half)."""
    factory = functools.partial(FSDP2Backend, ModelConfig(path=str(path)), trainer_config(args), device="cpu")
    with PeakMemory() as memory, Orchestration(ClusterConfig(trainer_ranks=2, device="cpu"), engines=False) as orch:
        group = orch.start_trainer(factory, shares=list(split_among(args.cores, 2)))
        timing = interleaved({"verst2": lambda: group.train_step(items, sft_loss_fn)}, args.steps)["verst2"]
        memory.poll()
    return timing, memory.by_role()


def trainer_config(args, **extra) -> TrainerConfig:
    return TrainerConfig(lr=1e-4, max_tokens_per_micro_batch=args.max_tokens, **extra)


def report_mfu(params: int, tokens: int, one: dict) -> None:
    """Model FLOPs utilisation on CUDA: 6 × parameters × tokens per step (forward and backward) over the
    GPU's dense bfloat16 peak."""
    name = torch.cuda.get_device_name()
    peak = next((flops for key, flops in PEAK_BF16.items() if key in name), None)
    if peak is None:
        print(f"MFU: no bfloat16 peak known for {name!r} (bench/train_throughput.py PEAK_BF16)")
        return
    for variant, (wall, _) in one.items():
        print(f"MFU {variant:<10} : {6 * params * tokens / wall / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s")


def report(name: str, args, tokens: int, one: dict, two: tuple | None) -> None:
    target = 0.05 if args.model else 0.15
    (plain_s, plain_cpu), (verst_s, verst_cpu) = one["plain"], one["verst"]
    overhead = verst_s / plain_s - 1.0
    print(f"model {name}, batch {args.batch} sequences, {tokens} tokens, budget {args.max_tokens}")
    print(f"plain transformers + AdamW : {tokens / plain_s:9.1f} tokens/s  ({plain_s * 1e3:.0f} ms/step)")
    print(f"verst FSDP2, 1 rank        : {tokens / verst_s:9.1f} tokens/s  ({verst_s * 1e3:.0f} ms/step)")
    print(f"verst overhead             : {overhead * 100:+.1f}% wall, {(verst_cpu / plain_cpu - 1) * 100:+.1f}% CPU time "
          f"(target <= {target:.0%}): {'ok' if overhead <= target else 'OVER TARGET'}")
    if "verst_ckpt" in one:
        ckpt_s = one["verst_ckpt"][0]
        print(f"  with activation ckpt     : {tokens / ckpt_s:9.1f} tokens/s  ({ckpt_s * 1e3:.0f} ms/step, "
              f"{ckpt_s / verst_s:.2f}x the step without)")
    print(f"peak RSS, this process (plain loop + 1-rank backends): {peak_rss_mib():.0f} MiB")
    if args.device == "cuda":
        print(f"peak CUDA memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if two is not None:
        (two_s, _), memory = two
        print(f"verst FSDP2, 2 ranks       : {tokens / two_s:9.1f} tokens/s  ({two_s * 1e3:.0f} ms/step, "
              f"{describe(args.cores)})")
        print("  peak RSS: " + ", ".join(f"{role} {mib:.0f} MiB" for role, mib in memory.items() if role != "driver"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--size", default="small")
    parser.add_argument("--model", help="instead of --arch/--size: smollm2 (SmolLM2-135M-Instruct), smollm2-135m-shape "
                        "or qwen3-0.6b-shape (random weights at those shapes), or a checkpoint dir")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: bfloat16 mixed precision, one rank on one GPU, with MFU")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    parser.add_argument("--max-tokens", type=int, default=2048, help="max_tokens_per_micro_batch")
    parser.add_argument("--ranks", default="1,2", help="1: the in-process variants; 2: two rank actors on Ray")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="skip the variant with activation checkpointing")
    parser.add_argument("--cores", type=int, default=None, help="CPU cores every variant gets (default: all): the "
                        "plain loop and the 1-rank backends one thread per core, the 2 ranks half of them each")
    args = parser.parse_args()
    args.cores = bench_cores(args.cores)
    pin_here(args.cores)
    torch.set_num_threads(len(args.cores))
    print(f"every variant on {describe(args.cores)}: the plain loop and 1 rank with {len(args.cores)} torch threads, "
          f"2 ranks with {' + '.join(str(s.threads) for s in split_among(args.cores, 2))}")
    from transformers import AutoConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    ranks = {r.strip() for r in args.ranks.split(",")}

    with tempfile.TemporaryDirectory() as tmp:
        path = resolve_model(args.model) if args.model else init_model(args.arch, args.size, Path(tmp) / "model")
        items = make_batch(args.batch, seed=0, vocab=AutoConfig.from_pretrained(path).vocab_size)
        one = one_rank(path, args, items) if "1" in ranks else None
        if "2" in ranks and args.device == "cuda":
            print("2 ranks: measured on the CPU only (two trainer ranks on CUDA need two GPUs)")
            ranks.discard("2")
        two = two_ranks(path, args, items) if "2" in ranks else None
        params = sum(math.prod(shape) for _, shape in safetensors_shapes(safetensors_files(path)))
    name = args.model or f"{args.arch}/{args.size}"
    tokens = sum(it.length for it in items)
    if one is not None:
        report(name, args, tokens, one, two)
        if args.device == "cuda":
            report_mfu(params, tokens, one)
    elif two is not None:
        print(f"model {name}: verst FSDP2, 2 ranks: {tokens / two[0][0]:.1f} tokens/s; {two[1]}")


if __name__ == "__main__":
    main()
