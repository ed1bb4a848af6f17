"""`eval.backend` functions of the e2e tests, loaded by import path in the driver."""

from __future__ import annotations

from examples.eval_backend.engine import score


def crashing_at_step_1(snapshot_dir: str, step: int, config) -> dict[str, float]:
    """The example backend (an engine process of its own), crashing at step 1."""
    if step == 1:
        raise RuntimeError("the harness fell over")
    return score(snapshot_dir, step, config)
