"""Stand-ins of the fast fault tests: an RL run over `tests/run_harness.py`'s parts whose checkpoints are
written (trainer ranks recording their background write as the real ones do, a rollout manager writing its
state), driven step by step as the loops do, and ended as `open_rl_run` ends a run that stops early."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from tests.run_harness import Ranks, harness_run, script_evaluation, train_step
from verst.monitor import MetricsLogger
from verst.orchestration.watchdog import RunFailure
from verst.run.ending import end_early
from verst.run.rl_run import RLRun
from verst.run.signals import STOP


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class CheckpointException(Exception):
    """What torch.distributed.checkpoint raises for a failed write: its text is a header and tracebacks, the
    rank's exception is in `failures` (rank -> (exception, traceback))."""

    def __init__(self, failures: dict[int, tuple[BaseException, str]]):
        super().__init__(f"CheckpointException ranks:{failures.keys()}\nTraceback (most recent call last): ...")
        self.failures = failures


class SavingRanks(Ranks):
    """Trainer ranks that save: the background write of version `fail_at` ends with `error` (a DCP failure
    around it), recorded by the real `persistence._record_write`; the others end done."""

    def __init__(self, fail_at: int | None = None, error: BaseException | None = None):
        super().__init__()
        self.fail_at, self.error, self.saves = fail_at, error, 0

    def save(self, directory: str, background: bool = False) -> None:
        from verst.trainer.persistence import _record_write

        self.saves += 1
        Path(directory).mkdir(parents=True, exist_ok=True)
        written: Future = Future()
        if self.saves == self.fail_at:
            written.set_exception(CheckpointException({0: (self.error, "Traceback ...")}))
        else:
            written.set_result(None)
        _record_write(Path(directory), 0, written)

    def load(self, directory: str) -> None:
        self.step = int(Path(directory).parent.name.removeprefix("step_"))  # RUN/checkpoints/step_N/trainer


class SavingManager:
    """The rollout manager: its state is a small file."""

    router_url = None

    def save_state(self, path: str) -> dict[str, int]:
        Path(path).write_bytes(b"rollout state")
        return {"groups": 0}

    def load_state(self, path: str) -> None:
        assert Path(path).read_bytes() == b"rollout state"


def saving_run(tmp_path: Path, *overrides: str, ranks: Ranks | None = None) -> RLRun:
    """A harness run that saves every step into tmp_path/run, logging to a real metrics.jsonl."""
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    logger = MetricsLogger.for_run(tmp_path / "run", tensorboard=False)
    run = harness_run(tmp_path, "--checkpoint.interval", "1", *overrides, logger=logger,
                      ranks=ranks or SavingRanks(), manager=SavingManager())
    script_evaluation(run, eval_s=0.0)
    return run


async def drive(run: RLRun, steps: int, during: Callable[[int], None] = lambda step: None) -> None:
    """The sync loop's steps over stand-ins (`during(step)` runs in each), ended as `open_rl_run` ends a run:
    an error or an interrupt goes through `end_early` and the exception it returns is raised."""
    STOP.attach()
    try:
        await run.begin()
        for step in range(1, steps + 1):
            start = time.perf_counter()
            metrics = await train_step(run)
            during(step)
            await run.end_step(metrics, start)
        await run.evaluator.finish(run.version)
        await run.checkpointer.wait()
    except BaseException as error:
        stopped = await end_early(run, error, _nothing_died)
        if stopped is error:
            raise
        raise stopped from None
    finally:
        await run.stop()
        STOP.detach()
        run.monitor.logger.close()


async def _nothing_died(error: BaseException) -> RunFailure | None:
    return None


def run_to_failure(run: RLRun, steps: int) -> RunFailure:
    """Drive `run` until it stops; its one-screen failure."""
    try:
        asyncio.run(drive(run, steps))
    except RunFailure as failure:
        return failure
    raise AssertionError("the run did not stop")


def check_screen(message: str, *, names: list[str], todo: str) -> None:
    """A fault's screen: not empty, one screen, no line cut or empty after its colon, naming each of `names`
    (the process or file, the OS error) and saying what to do (`todo`)."""
    lines = message.splitlines()
    assert lines and len(lines) <= 40, message
    assert not re.search(r"(Error|Exception|failed|error|rank \d+): *($|[;.,])", message, re.MULTILINE), message
    assert "(no message)" not in message or "no message:" in message, message
    for name in names:
        assert name in message, f"{name!r} not in:\n{message}"
    assert todo in message, f"{todo!r} not in:\n{message}"
