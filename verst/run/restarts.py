"""`fault.max_restarts`: an RL run whose trainer rank died continues from its latest checkpoint in the
same process, exactly as `verst train --resume RUN_DIR` would, at most `fault.max_restarts` times."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from verst.config import VerstConfig
from verst.monitor import checkpoint_dirs as layout
from verst.monitor.run_dir import run_dir_of
from verst.orchestration.watchdog import RunFailure

log = logging.getLogger(__name__)
RLLoop = Callable[..., Awaitable[dict[str, Any]]]  # loop(cfg, restarts=n) -> summary


async def run_restarting(loop: RLLoop, cfg: VerstConfig) -> dict[str, Any]:
    """`loop(cfg)`; when a trainer rank dies (a `RunFailure` naming one), the whole run — engines, rollout
    manager, trainer ranks — has been stopped by the loop's exit, and the loop starts again with
    `checkpoint.load` set to the run directory: the resume path restores the trainer, the data source,
    the buffer and the engines' weights and version, and the metrics continue after the checkpoint's step."""
    restarts = 0
    while True:
        try:
            return await loop(cfg, restarts=restarts)
        except RunFailure as failure:
            if not failure.trainer_died or restarts >= cfg.fault.max_restarts:
                raise
            cfg = restart_config(cfg, failure)
            restarts += 1
            log.warning("a trainer rank died; restart %d of %d from %s:\n%s", restarts, cfg.fault.max_restarts,
                        layout.read_latest(run_dir_of(cfg)), failure)


def restart_config(cfg: VerstConfig, failure: RunFailure) -> VerstConfig:
    """The config that resumes the run from its own latest checkpoint; `failure`, with the reason, when the
    run has saved none yet (a restart from step 0 would empty the run directory and its logs)."""
    run_dir = run_dir_of(cfg).resolve()
    if layout.read_latest(run_dir) is None:
        raise RunFailure(f"{failure}\n  not restarted (fault.max_restarts = {cfg.fault.max_restarts}): the run "
                         f"has saved no checkpoint in {run_dir / layout.CHECKPOINTS_DIR} yet "
                         f"(checkpoint.interval = {cfg.checkpoint.interval})", dead=failure.dead) from failure
    return cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"load": str(run_dir)})})
