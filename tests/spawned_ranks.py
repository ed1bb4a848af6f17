"""Trainer ranks in spawned processes for the parallelism tests: `spawn_ranks(target, world, args, out)` runs
`target(rank, *args)` in `world` processes (each joins a gloo group on 127.0.0.1 itself), waits for them, kills
any still alive, even when a rank failed, and returns what rank 0 pickled to `out`. What a rank reads off its
backend (`synced_weights`, `gradients`), and the checks of its tensors (`assert_tensors_close`) and of a checkpoint
resumed on another mesh (`assert_resumed_alike`), are shared by the tests of every layout."""

import multiprocessing
import os
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

# (prompt, response) tokens of the tests' train items: uneven lengths, most not multiples of 2 or 4 (a
# tensor-parallel group, 2 x a context-parallel one), several longer than a context-parallel chunk
LENGTHS = [(5, 4), (9, 7), (3, 12), (20, 6), (4, 1), (2, 9), (7, 3), (6, 5)]
TIMEOUT_S = 240  # a rank's whole job
# An RL learning rate. AdamW's first step moves each weight by about lr x sign(grad), so a gradient near zero
# (1e-10, where float32 reduction order shows) may move either way: the gradients are compared on their own.
LR = 1e-5


def spawn_ranks(target: Callable[..., None], world: int, args: tuple, out: Path, timeout_s: float) -> Any:
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank_then_exit, args=(target, rank, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout_s)
        codes = [proc.exitcode for proc in procs]
        assert codes == [0] * world, f"rank exit codes {codes}"
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    with open(out, "rb") as f:
        return pickle.load(f)


def _rank_then_exit(target: Callable[..., None], rank: int, *args: Any) -> None:
    """`target(rank, *args)` (which closes its process group), then the process ends without the interpreter's
    teardown: there gloo's threads were seen to abort a rank (exit -6, "terminate called without an active
    exception") after it had finished. A target that raises still exits non-zero."""
    target(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def synced_weights(backend) -> dict[str, torch.Tensor]:
    """What weight sync sends: full tensors gathered bucket by bucket (64 KiB) from the shards."""
    return {name: t.clone() for bucket in backend.named_weights(1 << 16) for name, t in bucket}


def gradients(backend) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (gathered from its shards)."""
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in backend.model.named_parameters() if p.grad is not None}


def assert_tensors_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    """The same names, each tensor within `atol` of `want`'s (gradients, or weights after a step)."""
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=0, msg=name)


def assert_resumed_alike(saved: dict, resumed: dict, directory: Path) -> None:
    """A checkpoint saved on one mesh (`saved-hf`, then a step: `saved["weights"]`) and resumed on another
    (`resumed-hf`, the same step): the two HF exports bit-identical, the next step's weights within 1e-6."""
    exported = load_file(directory / "saved-hf/model.safetensors")
    reloaded = load_file(directory / "resumed-hf/model.safetensors")
    assert exported.keys() == reloaded.keys()
    for name, tensor in exported.items():
        assert torch.equal(reloaded[name], tensor), name
    for name, weight in saved["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], weight, atol=1e-6, rtol=0, msg=name)
