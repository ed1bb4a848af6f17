"""The lanes of an RL run: what one trained policy uses (its run config, batch plan, rollout manager, step
count, scores). A run has one lane; a multi-LoRA run (`lora.adapters`) one per adapter, interleaved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from verst.config import BatchPlan, VerstConfig

if TYPE_CHECKING:
    from verst.orchestration import RolloutSource

GLOBAL_PREFIXES = ("time/startup", "fault/")  # of the run, not of one adapter's step
ROLLOUT_FILE = "rollout.pkl"  # a checkpoint's rollout side state (multi-LoRA: rollout_<name>.pkl each)


@dataclasses.dataclass
class Lane:
    """One trained policy of a run. `adapter`: its name on the engines and the trainer (multi-LoRA), None
    for a run's only policy (whose steps are the run's version)."""

    cfg: VerstConfig  # its run config (multi-LoRA: `adapter_run_config`)
    plan: BatchPlan
    rollout: RolloutSource  # its rollout manager: its data source, reward, buffer and worker
    adapter: str | None = None
    steps: int = 0  # optimizer steps it has taken
    eval_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (run version, score)

    @property
    def done(self) -> bool:
        return self.steps >= self.plan.total_train_steps

    @property
    def first_rollout(self) -> int:
        """The rollout batch this lane starts at (past those of a resumed checkpoint)."""
        return self.steps // self.plan.train_steps_per_rollout

    @property
    def num_rollouts(self) -> int:
        return self.cfg.rollout.num_rollouts

    @property
    def prefix(self) -> str:
        """Its metrics' namespace: `lora/<name>/` (none for a run's only policy)."""
        return f"lora/{self.adapter}/" if self.adapter else ""

    def namespaced(self, metrics: dict[str, float]) -> dict[str, float]:
        """A step's metrics under the lane's namespace; the run's own (start-up, faults) stay as they are."""
        if not self.adapter:
            return metrics
        return {key if key.startswith(GLOBAL_PREFIXES) else self.prefix + key: value
                for key, value in metrics.items()}

    @property
    def rollout_file(self) -> str:
        """Its rollout side's state in a checkpoint."""
        return f"rollout_{self.adapter}.pkl" if self.adapter else ROLLOUT_FILE


def turns(lanes: list[Lane]) -> Iterator[Lane]:
    """Fully async: the lane of each next train step, round robin over the lanes with steps left."""
    while pending := [lane for lane in lanes if not lane.done]:
        for lane in pending:
            if not lane.done:
                yield lane


def rollout_ids(lanes: list[Lane]) -> Iterator[tuple[int, Lane]]:
    """Sync: (rollout batch, lane) pairs, each rollout batch of every lane in turn, past a resumed checkpoint's."""
    start, stop = min(lane.first_rollout for lane in lanes), max(lane.num_rollouts for lane in lanes)
    for rollout_id in range(start, stop):
        for lane in lanes:
            if lane.first_rollout <= rollout_id < lane.num_rollouts:
                yield rollout_id, lane


Span = tuple[tuple[int | None, float | None], tuple[int | None, float | None]]


def score_span(history: list[tuple[int, float]]) -> Span:
    """The first and last (version, score) of an evaluation history; (None, None) twice when it is empty
    (every evaluation was skipped: `eval.on_error = "skip"`)."""
    return (history[0], history[-1]) if history else ((None, None), (None, None))


def summary(lanes: list[Lane], score_key: str) -> dict[str, Any]:
    """summary.json's per-adapter scores: `lora/<name>/eval/accuracy_before` and `_after` (with versions)."""
    out: dict[str, Any] = {}
    for lane in lanes:
        if lane.adapter is None:
            continue
        (v0, before), (v1, after) = score_span(lane.eval_history)
        out |= {f"{lane.prefix}{score_key}_before": before, f"{lane.prefix}{score_key}_after": after,
                f"{lane.prefix}eval/version_before": v0, f"{lane.prefix}eval/version_after": v1,
                f"{lane.prefix}train/steps": lane.steps}
    return out


def adapter_score_lines(lanes: list[Lane], summary: dict[str, Any], score_key: str) -> list[str]:
    """One line per adapter with its held-out score before and after (multi-LoRA's end of run)."""
    lines = []
    for lane in lanes:
        before, after = summary[f"{lane.prefix}{score_key}_before"], summary[f"{lane.prefix}{score_key}_after"]
        moved = "no evaluation" if before is None else f"{before:.1%} -> {after:.1%}"
        lines.append(f"adapter {lane.adapter}: held-out greedy {score_key[5:]} {moved} in {lane.steps} steps")
    return lines
