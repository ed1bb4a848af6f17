"""Why an evaluation point has no score: `EvalSkip` carries a reason (logged as `eval/skipped_<reason>`),
and `accept` refuses a score that does not measure the weights of its step (`pin_violation`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_REASON = re.compile(r"^[a-z0-9_]+$")


class EvalSkip(Exception):
    """Raised by an evaluation (or an `eval.backend` function) that gives no score for this point:
    `raise EvalSkip("busy", "the harness is still running")` logs `eval/skipped_busy`; training goes on."""

    def __init__(self, reason: str, message: str = ""):
        if not _REASON.match(reason):
            raise ValueError(f"EvalSkip reason must be lowercase letters, digits and '_', got {reason!r}")
        super().__init__(message or reason)
        self.reason = reason


class MixedVersionError(EvalSkip):
    """An evaluation's replies came from weights other than the ones it was meant to measure."""

    def __init__(self, message: str):
        super().__init__("pin_violation", message)


def skip_reason(error: BaseException) -> str:
    """The `eval/skipped_<reason>` of a failed evaluation: an EvalSkip's own reason, `timeout`, `unhealthy`
    (an engine that does not answer, or answers with a server error), else `error`."""
    from verst.inference_client.client import EngineError

    if isinstance(error, EvalSkip):
        return error.reason
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, EngineError) and (error.status is None or error.status >= 500):
        return "unhealthy"
    return "error"


def skipped(reason: str) -> dict[str, float]:
    return {"eval/skipped": 1.0, f"eval/skipped_{reason}": 1.0}


def version_metrics(versions: Sequence[Sequence[str]]) -> dict[str, float]:
    """`eval/weight_version` (the mean over the samples' replies) and `eval/mixed_version_ratio` (the
    share of samples whose replies came from more than one version), from each sample's reply versions."""
    per_reply = [float(v) for sample in versions for v in sample]
    if not per_reply:
        return {}
    mixed = sum(len(set(sample)) > 1 for sample in versions)
    return {"eval/weight_version": sum(per_reply) / len(per_reply), "eval/mixed_version_ratio": mixed / len(versions)}


def accept(metrics: dict[str, float], step: int) -> None:
    """A score stands for step `step` only if its samples' mean weight version is `step` and none mixed
    versions; else `EvalSkip("pin_violation")`. Metrics without versions (a backend that reports none)
    are taken as they are."""
    version = metrics.get("eval/weight_version")
    if version is not None and version != step:
        raise MixedVersionError(f"the evaluation of step {step} measured weight version {version:g}")
    if metrics.get("eval/mixed_version_ratio", 0.0) > 0:
        raise MixedVersionError(f"the evaluation of step {step} mixed weight versions "
                                f"({metrics['eval/mixed_version_ratio']:.0%} of its samples)")
