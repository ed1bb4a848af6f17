"""The evaluation fleet (`eval.num_engines`): engines of their own behind a router of their own, outside the
weight sync; each evaluation point's snapshot is loaded onto every engine, its version checked, then scored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.data import held_out_prompts
from verst.eval.backend import in_daemon_thread
from verst.eval.local import run_tokenizer, score_url
from verst.eval.skip import EvalSkip, skip_reason
from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet, FleetError
from verst.router.manager import RouterManager

log = logging.getLogger(__name__)


class EvalFleet:
    """The driver's handle of the evaluation engines at `urls` (`engines`: their actor group, which restarts
    one that died; None: nothing to restart). `score(snapshot, step)` loads the snapshot onto every engine as
    weight version `step` (`/update_weights_from_disk`), asks each engine its version before any request is
    sent (another one: `EvalSkip("pin_violation")`), then scores the held-out prompts through the fleet's
    router (`router`: its policy and assignment mode; None: the one engine directly). The engines serve one
    version at a time, so the snapshots are scored one after the other."""

    def __init__(self, cfg: VerstConfig, urls: list[str], *, engines: Any = None,
                 router: tuple[str, str] | None = None, log_path: str | Path | None = None):
        if not urls:
            raise ValueError("an evaluation fleet needs at least one engine URL (eval.num_engines)")
        if router is None and len(urls) > 1:
            raise ValueError(f"an evaluation fleet of {len(urls)} engines needs a router in front of them")
        self.cfg, self.urls, self.engines = cfg, [url.rstrip("/") for url in urls], engines
        self._router_settings, self._log_path = router, log_path
        self.router: RouterManager | None = None
        self.url = self.urls[0]  # where the scoring requests go: the router, once started
        self.fleet = EngineFleet(self.urls, timeouts=Timeouts(control=cfg.fault.engine_call_timeout_s))
        self._lock = asyncio.Lock()
        self._inputs: tuple[Any, list] | None = None  # the tokenizer and the held-out prompts, read once

    async def __aenter__(self) -> EvalFleet:
        if self._router_settings is not None:
            policy, assignment_mode = self._router_settings
            self.router = RouterManager(self.urls, policy=policy, assignment_mode=assignment_mode,
                                        log_path=self._log_path)
            await asyncio.to_thread(self.router.start)
            self.url = self.router.url
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.fleet.close()
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)

    async def score(self, snapshot: str | Path, step: int) -> dict[str, float]:
        """`eval/` metrics of the weights in `snapshot` (a Hugging Face checkpoint directory) as step `step`,
        with `eval/fleet_load_seconds` (load and version check) and `eval/fleet_restarts`."""
        async with self._lock:
            start = time.perf_counter()
            restarts = await self.load(snapshot, step)
            await self.check_versions(step)
            loaded = time.perf_counter() - start
            tokenizer, prompts = self._held_out()
            metrics = await in_daemon_thread(score_url, self.cfg, self.url, tokenizer, prompts, step)
        return metrics | {"eval/fleet_load_seconds": loaded, "eval/fleet_restarts": float(restarts)}

    async def load(self, snapshot: str | Path, step: int) -> int:
        """Every engine serves `snapshot` as version `step`: loaded from disk, or, for an engine that no longer
        answers, restarted serving it (out of the router meanwhile). Returns how many were restarted."""
        if not Path(snapshot).is_dir():
            raise EvalSkip("snapshot_missing", f"the snapshot of step {step} is not there: {snapshot}")
        try:
            await self.fleet.update_weights_from_disk(str(snapshot), str(step))
            return 0
        except FleetError as error:
            failed = error
        health = await self.fleet.health()
        dead = [url for url in failed.failures if not health[url]]
        if len(dead) < len(failed.failures):  # an engine that answers refused it: `unhealthy` on a server error
            reason = skip_reason(next(exc for url, exc in failed.failures.items() if url not in dead))
            raise EvalSkip(reason, f"loading the snapshot of step {step}: {failed}") from failed
        if self.engines is None:
            raise EvalSkip("unhealthy", f"loading the snapshot of step {step}: {failed}") from failed
        for url in dead:
            await self._restart(self.urls.index(url), snapshot, step)
        return len(dead)

    async def check_versions(self, step: int) -> None:
        """Every engine must report weight version `step` before a request is sent: else the point's replies
        could come from other weights (`EvalSkip("pin_violation")`)."""
        try:
            versions = await self.fleet.weight_versions()
        except FleetError as error:
            raise EvalSkip("unhealthy", f"asking the evaluation engines their weight version: {error}") from error
        wrong = {url: version for url, version in versions.items() if version != str(step)}
        if wrong:
            raise EvalSkip("pin_violation", f"the evaluation engines were loaded with the snapshot of step {step}, "
                           f"but {len(wrong)} of them report other weight versions: {wrong}")

    async def _restart(self, index: int, snapshot: str | Path, step: int) -> None:
        url = self.urls[index]
        try:
            if self.router is not None:
                with contextlib.suppress(KeyError):  # the router may have dropped it already
                    await asyncio.to_thread(self.router.remove_engine, url)
            await asyncio.to_thread(self.engines.restart, index, str(snapshot), step)
            if self.router is not None:
                await asyncio.to_thread(self.router.add_engine, url)
        except Exception as error:
            raise EvalSkip("unhealthy", f"evaluation engine {index} ({url}) did not answer and did not restart: "
                           f"{type(error).__name__}: {error}") from error
        log.warning("evaluation engine %d (%s) restarted serving the snapshot of step %d", index, url, step)

    def _held_out(self) -> tuple[Any, list]:
        if self._inputs is None:
            self._inputs = run_tokenizer(self.cfg.model.path), held_out_prompts(self.cfg)
        return self._inputs


@contextlib.asynccontextmanager
async def open_eval_fleet(cfg: VerstConfig, engines: Any, log_dir: Path,
                          router: tuple[str, str] | None) -> AsyncIterator[EvalFleet | None]:
    """The run's evaluation fleet over the started `engines` (an `EngineActorGroup`; None: no fleet), behind a
    router of its own (`router`: policy and assignment mode; None: the one engine directly); stopped on exit."""
    if engines is None:
        yield None
        return
    async with EvalFleet(cfg, engines.wait_ready().urls, engines=engines, router=router,
                         log_path=log_dir / "eval-router.log") as fleet:
        yield fleet
