"""Exact accounting of a simulated run: every group the data source served ends exactly one way — trained
once, discarded by the buffer with its reason, dropped inside a rollout step (filtered or failed), handed back
unfinished, or still waiting in the buffer at the end — and none is trained twice.

The run's own extension points record it: `AccountedSource` (`data.source`) the groups served and returned,
`AccountedBuffer` (`buffer.path`) the discards with their reasons, the simulated trainer the groups trained.
They write to `LEDGER`, this process's one ledger: a simulated run keeps its rollout manager in the driver's
process, and one simulated run runs in a process at a time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

from verst.config import DataConfig
from verst.data import PromptSource
from verst.data.loading import DATA_INDEX_KEY, load_prompts_from_config
from verst.rollout.buffer import DiscardReason, FifoBuffer, OnDiscard
from verst.rollout.filters import GroupFilter
from verst.types import Group, Sample


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.served: dict[int, int] = {}  # group index -> data row
        self.discarded: dict[int, str] = {}  # group index -> reason
        self.returned: set[int] = set()  # groups whose prompt went back to the source
        self.trained: collections.Counter[int] = collections.Counter()
        self.buffer: AccountedBuffer | None = None  # the run's buffer (fully async), whose queue ends the run

    def reset(self) -> None:
        with self._lock:
            self.served, self.discarded, self.returned = {}, {}, set()
            self.trained = collections.Counter()
            self.buffer = None

    def serve(self, groups: list[Group]) -> None:
        with self._lock:
            for group in groups:
                self.served[group[0].group_index] = group[0].metadata.get(DATA_INDEX_KEY, -1)

    def give_back(self, samples: Sequence[Sample]) -> None:
        with self._lock:
            self.returned |= {s.group_index for s in samples}

    def discard(self, group: Group, reason: str) -> None:
        with self._lock:
            self.discarded[group[0].group_index] = reason

    def train(self, groups: Sequence[Group]) -> None:
        with self._lock:
            self.trained.update(group[0].group_index for group in groups)

    def report(self, queued: Sequence[int], dropped_in_steps: int, unfinished: int) -> dict[str, Any]:
        """Where every served group went. `queued`: group indices left in the buffer; `dropped_in_steps`: the
        groups the rollout fn's steps filtered or lost (their metrics' count); `unfinished`: the groups the
        fully async worker handed back when it stopped. `problems` lists what does not add up (empty: exact)."""
        with self._lock:
            served, trained = set(self.served), set(self.trained)
            doubles = sorted(g for g, n in self.trained.items() if n > 1)
            unknown = sorted(trained - served)
            discarded = set(self.discarded) - trained
            queued_set = set(queued)
            returned = self.returned - trained - discarded - queued_set
            rest = served - trained - discarded - queued_set - returned
            reasons = collections.Counter(self.discarded[g] for g in discarded)
        problems = []
        if doubles:
            problems.append(f"groups trained more than once: {doubles[:10]}")
        if unknown:
            problems.append(f"groups trained that the source never served: {unknown[:10]}")
        if len(rest) != dropped_in_steps + unfinished:
            problems.append(f"{len(rest)} served groups are neither trained, discarded, returned nor queued, but the "
                            f"rollout steps dropped {dropped_in_steps} and {unfinished} were left unfinished")
        return {"served": len(served), "trained": len(trained), "discarded": dict(reasons),
                "returned": len(returned), "queued": len(queued_set), "dropped_in_steps": dropped_in_steps,
                "unfinished": unfinished, "problems": problems}


LEDGER = Ledger()


class AccountedSource(PromptSource):
    """The prompt source of `data` (`PromptSource`), recording the groups it serves and gets back."""

    def __init__(self, data: DataConfig):
        super().__init__(load_prompts_from_config(data, "train"), shuffle=data.shuffle, seed=data.seed)

    def next_groups(self, n_prompts: int, n_samples_per_prompt: int) -> list[Group]:
        groups = super().next_groups(n_prompts, n_samples_per_prompt)
        LEDGER.serve(groups)
        return groups

    def return_prompts(self, samples: Sequence[Sample]) -> None:
        super().return_prompts(samples)
        LEDGER.give_back(samples)


class AccountedBuffer(FifoBuffer):
    """The default buffer, recording each discarded group with its reason before its own `on_discard`."""

    def __init__(self, capacity_groups: int, *, max_staleness: int | None = None,
                 group_filter: GroupFilter | None = None, on_discard: OnDiscard | None = None):
        def record(group: Group, reason: DiscardReason) -> None:
            LEDGER.discard(group, reason)
            if on_discard is not None:
                on_discard(group, reason)

        super().__init__(capacity_groups, max_staleness=max_staleness, group_filter=group_filter, on_discard=record)
        LEDGER.buffer = self

    def queued_groups(self) -> list[int]:
        return [group[0].group_index for group in self.state_dict()["groups"]]
