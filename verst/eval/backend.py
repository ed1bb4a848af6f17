"""The external evaluation backend (`eval.backend`): a user function that scores a Hugging Face snapshot of
the weights at one step, run in a daemon thread while training goes on; and the snapshots it reads.

    def score(snapshot_dir: str, step: int) -> dict[str, float]: ...          # or raise EvalSkip(reason)
    def score(snapshot_dir: str, step: int, config: VerstConfig) -> dict[str, float]: ...
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import os
import re
import shutil
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from verst.config.imports import load_object
from verst.eval.skip import EvalSkip

SNAPSHOTS_DIR = "eval_snapshots"  # in the run directory
_STEP_DIR = re.compile(r"^step_(\d+)$")


def load_backend(path: str) -> Callable[..., Any]:
    fn = load_object(path, "eval.backend")
    if not callable(fn):
        raise TypeError(f"eval.backend = {path!r} is not callable")
    return fn


def call_backend(fn: Callable[..., Any], snapshot: Path, step: int, cfg: Any) -> dict[str, float]:
    """`fn(snapshot_dir, step[, config=cfg])` as `eval/` metrics. A missing snapshot is skipped
    (`snapshot_missing`); an `EvalSkip` passes through; any other failure, or a reply that is not a dict
    of numbers, is `backend_crashed`."""
    if not snapshot.is_dir():
        raise EvalSkip("snapshot_missing", f"the snapshot of step {step} is not there: {snapshot}")
    kwargs = {"config": cfg} if _accepts(fn, "config") else {}
    try:
        reply = fn(str(snapshot), step, **kwargs)
    except EvalSkip:
        raise
    except Exception as error:
        raise EvalSkip("backend_crashed", f"eval.backend raised {type(error).__name__}: {error}") from error
    if not isinstance(reply, Mapping) or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) for v in reply.values()):
        raise EvalSkip("backend_crashed", f"eval.backend returned {type(reply).__name__} {str(reply)[:200]}; "
                       "it must return a dict of metric names to numbers")
    return {(k if str(k).startswith("eval/") else f"eval/{k}"): float(v) for k, v in reply.items()}


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread: a backend that never returns can be given up on (timeout, the run's
    end) without holding the process's exit, as a thread of asyncio's default executor would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(outcome: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)

    def run() -> None:
        try:
            outcome, error = fn(*args), None
        except BaseException as raised:  # handed to the awaiting task
            outcome, error = None, raised
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle, outcome, error)

    threading.Thread(target=run, name="verst-eval-backend", daemon=True).start()
    return await future


# ---- snapshots ---------------------------------------------------------------------------------------
def snapshot_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / SNAPSHOTS_DIR / f"step_{step:08d}"


def link_snapshot(source: Path, target: Path) -> None:
    """A copy of the checkpoint `source` at `target` made of hard links (no bytes copied; it outlives the
    source's pruning), falling back to a copy across file systems; written aside, then renamed."""
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, tmp, copy_function=link)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def retire_snapshots(run_dir: Path, keep: int, in_use: Collection[int] = ()) -> list[Path]:
    """Delete the evaluation snapshots of the run but the newest `keep` and those of `in_use` steps."""
    root = Path(run_dir) / SNAPSHOTS_DIR
    if not root.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())
    old = [path for step, path in found[: max(len(found) - keep, 0)] if step not in in_use]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old
