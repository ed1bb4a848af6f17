"""The Hugging Face snapshots a snapshot evaluation reads (`RUN/eval_snapshots/step_N`): step 0 is
`model.path` itself; a later step links the weight push's own snapshot of it where the transport keeps one,
else the trainer ranks export the step's weights (a pause of training).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from verst.eval.backend import link_snapshot, snapshot_dir
from verst.run.guard import Guard
from verst.trainer.backend import MERGED_LORA_DIR, TrainerRanks, export_backend


class EvalSnapshots:
    """`pushed(step)`: the weight push's full-model snapshot of `step`, or None (see
    `WeightPush.model_snapshot`); `lora`: an export is an adapter, whose merged model is the snapshot."""

    def __init__(self, run_dir: Path, ranks: TrainerRanks, guard: Guard, *, lora: bool,
                 pushed: Callable[[int], Path | None]):
        self.run_dir, self.ranks, self.guard, self.lora, self.pushed = Path(run_dir), ranks, guard, lora, pushed

    async def write(self, step: int) -> dict[str, float]:
        """The snapshot of `step` in place; `eval/export_seconds` and `eval/snapshot_reused`."""
        if step == 0:
            return {}
        start, target = time.perf_counter(), snapshot_dir(self.run_dir, step)
        kept = self.pushed(step)
        if kept is not None:
            await asyncio.to_thread(link_snapshot, kept, target)
            return {"eval/export_seconds": time.perf_counter() - start, "eval/snapshot_reused": 1.0}
        export = target.with_name(f".tmp-{target.name}")
        await self.guard(f"exporting the evaluation snapshot of step {step}", "step_timeout_s",
                         asyncio.to_thread(self.ranks.apply, export_backend, str(export), self.lora))
        _move_export(export, target, self.lora)
        return {"eval/export_seconds": time.perf_counter() - start, "eval/snapshot_reused": 0.0}


def _move_export(export: Path, target: Path, lora: bool) -> None:
    """An export into place; with LoRA its merged model (the adapter alone is not a full checkpoint)."""
    source = export / MERGED_LORA_DIR if lora else export
    shutil.rmtree(target, ignore_errors=True)
    source.rename(target)
    shutil.rmtree(export, ignore_errors=True)
