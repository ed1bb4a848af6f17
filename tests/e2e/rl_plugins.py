"""Plug-ins the RL e2e tests load by import path inside the rollout manager actor; they record what
happened into files under $VERST_TEST_RECORD_DIR so the test can compare them with the metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

from verst.data import PromptSource
from verst.rollout import FifoBuffer


def _record(name: str, entry: dict) -> None:
    path = Path(os.environ["VERST_TEST_RECORD_DIR"]) / f"{name}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


class CountingSource(PromptSource):
    def return_prompts(self, samples):
        groups = sorted({s.group_index for s in samples})
        _record("returned", {"groups": groups, "samples": len(samples)})
        super().return_prompts(samples)


def counting_source(data_cfg):
    return CountingSource.from_config(data_cfg)


class RecordingBuffer(FifoBuffer):
    """The default buffer, recording every group it discards and why."""

    def __init__(self, capacity_groups, *, max_staleness=None, group_filter=None, on_discard=None):
        def record(group, reason):
            _record("discarded", {"group": group[0].group_index, "reason": reason})
            if on_discard is not None:
                on_discard(group, reason)

        super().__init__(capacity_groups, max_staleness=max_staleness, group_filter=group_filter, on_discard=record)


class AccountingBuffer(RecordingBuffer):
    """Also records, with this process's id, the rows each take hands to training and each checkpoint
    of the buffer (`state_dict`), so a test can follow every prompt across a resume."""

    async def take(self, n, current_version, timeout=None):
        groups = await super().take(n, current_version, timeout)
        for group in groups:
            _record("accounting", {"pid": os.getpid(), "event": "trained", "row": group[0].metadata["data_index"],
                                   "version": current_version})
        return groups

    def state_dict(self):
        _record("accounting", {"pid": os.getpid(), "event": "checkpoint", "version": self._last_version})
        return super().state_dict()

    def _discard(self, group, reason):
        _record("accounting", {"pid": os.getpid(), "event": reason, "row": group[0].metadata["data_index"]})
        super()._discard(group, reason)


async def non_digit_share(sample) -> float:
    """A reward a random tiny model already earns most of (the fraction of its response's characters that
    are not digits): its returns vary around a mean far from 0, which a critic starting at 0 must fit."""
    text = sample.response
    return sum(not c.isdigit() for c in text) / len(text) if text else 0.0
