"""Trainer ranks in spawned processes for the parallelism tests: `spawn_ranks(target, world, args, out)` runs
`target(rank, *args)` in `world` processes (each joins a gloo group on 127.0.0.1 itself), waits for them, kills
any still alive, even when a rank failed, and returns what rank 0 pickled to `out`."""

import multiprocessing
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any


def spawn_ranks(target: Callable[..., None], world: int, args: tuple, out: Path, timeout_s: float) -> Any:
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
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
