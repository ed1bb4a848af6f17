"""Train-step throughput: verst's FSDP2 backend (1 rank, then 2 ranks) against a plain transformers +
AdamW loop on the same model and batch, measured in one run. Target: verst overhead <= 15%.

    .venv/bin/python bench/train_throughput.py [--arch qwen3] [--size small] [--steps 6]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from verst.config.schema import ClusterConfig, ModelConfig, TrainerConfig  # noqa: E402
from verst.models.factory import init_model  # noqa: E402
from verst.orchestration import Orchestration  # noqa: E402
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


def plain_step(model, optimizer, micro_batches, total_tokens: int, grad_clip: float) -> None:
    """The baseline: padded rows with an attention mask, masked NLL, clip, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    for batch in micro_batches:
        width = batch[0].length
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, it in enumerate(batch):
            ids[r, : it.length], mask[r, : it.length] = it.tokens, 1
            labels[r, it.prompt_length : it.length] = it.tokens[it.prompt_length :]
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
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (_median([w for w, _ in s]), _median([c for _, c in s])) for name, s in samples.items()}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    parser.add_argument("--max-tokens", type=int, default=2048, help="max_tokens_per_micro_batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as tmp:
        path = init_model(args.arch, args.size, Path(tmp) / "model")
        model_cfg = ModelConfig(path=str(path))
        trainer_cfg = TrainerConfig(lr=1e-4, max_tokens_per_micro_batch=args.max_tokens)
        vocab = AutoConfig.from_pretrained(path).vocab_size
        items = make_batch(args.batch, seed=0, vocab=vocab)
        tokens = sum(it.length for it in items)
        policy_tokens = sum(it.response_length for it in items)

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        micro = plain_micro_batches(items, args.max_tokens)
        backend = FSDP2Backend(model_cfg, trainer_cfg, device="cpu")
        one_rank = interleaved(
            {
                "plain": lambda: plain_step(model, optimizer, micro, policy_tokens, 1.0),
                "verst": lambda: backend.train_step(items, sft_loss_fn),
            },
            args.steps,
        )
        model = optimizer = backend = None  # free the 1-rank copies before starting two ranks
        factory = functools.partial(FSDP2Backend, model_cfg, trainer_cfg, device="cpu")
        # Two rank actors on a local Ray, as `verst sft` starts them with cluster.trainer_ranks = 2.
        with Orchestration(ClusterConfig(trainer_ranks=2, device="cpu"), engines=False) as orch:
            group = orch.start_trainer(factory)
            two_rank = interleaved({"verst2": lambda: group.train_step(items, sft_loss_fn)}, args.steps)["verst2"]

    (plain_s, plain_cpu), (verst_s, verst_cpu) = one_rank["plain"], one_rank["verst"]
    overhead = verst_s / plain_s - 1.0
    print(f"model {args.arch}/{args.size}, batch {args.batch} sequences, {tokens} tokens, budget {args.max_tokens}")
    print(f"plain transformers + AdamW : {tokens / plain_s:9.0f} tokens/s  ({plain_s * 1e3:.0f} ms/step)")
    print(f"verst FSDP2, 1 rank        : {tokens / verst_s:9.0f} tokens/s  ({verst_s * 1e3:.0f} ms/step)")
    print(f"verst overhead             : {overhead * 100:+.1f}% wall, {(verst_cpu / plain_cpu - 1) * 100:+.1f}% CPU time "
          f"(target <= 15%): {'ok' if overhead <= 0.15 else 'OVER TARGET'}")
    print(f"verst FSDP2, 2 ranks       : {tokens / two_rank[0]:9.0f} tokens/s  ({two_rank[0] * 1e3:.0f} ms/step, "
          f"{os.cpu_count()} CPU cores)")


if __name__ == "__main__":
    main()
