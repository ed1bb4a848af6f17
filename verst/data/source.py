"""The prompt source: seeded per-epoch order, groups for rollouts, returned prompts, resumable position.

Every served prompt is a fresh Sample stamped with its row number (`metadata['data_index']`).
"""

from __future__ import annotations

import copy
import random
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from verst.config import DataConfig
from verst.data.loading import DATA_INDEX_KEY, DataError, load_prompts_from_config
from verst.types import Group, Sample, expand_group

STATE_FORMAT = 1


class DataSource(Protocol):
    """What a rollout fn needs from a prompt source; a replacement by import path provides these."""

    @property
    def epoch(self) -> int: ...
    def next_prompts(self, n: int) -> list[Sample]: ...
    def next_groups(self, n_prompts: int, n_samples_per_prompt: int) -> list[Group]: ...
    def return_prompts(self, samples: Sequence[Sample]) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PromptSource:
    """Serves prompts in a seeded order that is reshuffled every epoch and wraps around forever.

    Prompts handed back with `return_prompts` are served again before any new one, once per group.
    `group_index` and `index` of the samples from `next_groups` keep increasing across calls.
    """

    def __init__(self, prompts: Sequence[Sample], *, shuffle: bool = True, seed: int = 42):
        if not prompts:
            raise DataError("PromptSource: no prompts")
        self._prompts = list(prompts)
        self._shuffle, self._seed = shuffle, seed
        self._epoch = 0  # completed passes over the data = the epoch the next new prompt comes from
        self._cursor = 0  # position in this epoch's order
        self._order = self._epoch_order(0)
        self._returned: deque[int] = deque()  # row numbers, served before new prompts
        self._next_group_index = 0
        self._next_sample_index = 0

    @classmethod
    def from_config(cls, cfg: DataConfig, split: str = "train") -> PromptSource:
        return cls(load_prompts_from_config(cfg, split), shuffle=cfg.shuffle, seed=cfg.seed)

    def __len__(self) -> int:
        return len(self._prompts)

    @property
    def epoch(self) -> int:
        """Number of complete passes over the prompts so far."""
        return self._epoch

    # ---- serving -------------------------------------------------------------------------
    def next_prompts(self, n: int) -> list[Sample]:
        """The next `n` prompts (returned ones first) as fresh Samples without group numbering."""
        if n < 0:
            raise DataError(f"next_prompts: n must be >= 0, got {n}")
        rows = []
        while len(rows) < n:
            rows.append(self._returned.popleft() if self._returned else self._advance())
        return [self._serve(row) for row in rows]

    def next_groups(self, n_prompts: int, n_samples_per_prompt: int) -> list[Group]:
        """`n_prompts` groups of `n_samples_per_prompt` copies of one prompt each, numbered globally."""
        if n_samples_per_prompt < 1:
            raise DataError(f"next_groups: n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        groups = []
        for prompt in self.next_prompts(n_prompts):
            groups.append(expand_group(prompt, n_samples_per_prompt, self._next_group_index, self._next_sample_index))
            self._next_group_index += 1
            self._next_sample_index += n_samples_per_prompt
        return groups

    def return_prompts(self, samples: Sequence[Sample]) -> None:
        """Queue the prompts of unused samples to be served again first, once per group."""
        seen = set()
        for s in samples:
            row = s.metadata.get(DATA_INDEX_KEY)
            if not isinstance(row, int) or not 0 <= row < len(self._prompts):
                raise DataError(
                    f"return_prompts: sample {s.index} (group {s.group_index}) has metadata[{DATA_INDEX_KEY!r}] = "
                    f"{row!r}, not a row of this source (0..{len(self._prompts) - 1})"
                )
            if (s.group_index, row) not in seen:
                seen.add((s.group_index, row))
                self._returned.append(row)

    # ---- resumable position --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position as plain JSON data: epoch, cursor, returned prompts and numbering counters."""
        return {
            "format": STATE_FORMAT,
            "n_prompts": len(self._prompts),
            "shuffle": self._shuffle,
            "seed": self._seed,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "returned": list(self._returned),
            "next_group_index": self._next_group_index,
            "next_sample_index": self._next_sample_index,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the data and the shuffle settings must be the same."""
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"data source state format {state.get('format')!r} unsupported (expected {STATE_FORMAT})")
        mine = {"n_prompts": len(self._prompts), "shuffle": self._shuffle, "seed": self._seed}
        for key, value in mine.items():
            if state[key] != value:
                raise DataError(f"data source state has {key} = {state[key]!r}, but this source has {value!r}")
        if not 0 <= state["cursor"] < len(self._prompts):
            raise DataError(f"data source state cursor {state['cursor']} outside [0, {len(self._prompts)})")
        bad = [r for r in state["returned"] if not 0 <= r < len(self._prompts)]
        if bad:
            raise DataError(f"data source state returned rows {bad[:5]} outside [0, {len(self._prompts)})")
        self._epoch, self._cursor = state["epoch"], state["cursor"]
        self._order = self._epoch_order(self._epoch)
        self._returned = deque(state["returned"])
        self._next_group_index = state["next_group_index"]
        self._next_sample_index = state["next_sample_index"]

    # ---- internals -----------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self._shuffle:
            # A string seed is hashed (sha512) by `random`, so the order depends on (seed, epoch) only.
            random.Random(f"verst.data/{self._seed}/{epoch}").shuffle(order)
        return order

    def _advance(self) -> int:
        row = self._order[self._cursor]
        self._cursor += 1
        if self._cursor == len(self._prompts):
            self._epoch, self._cursor = self._epoch + 1, 0
            self._order = self._epoch_order(self._epoch)
        return row

    def _serve(self, row: int) -> Sample:
        p = self._prompts[row]
        metadata = copy.deepcopy(p.metadata)
        metadata[DATA_INDEX_KEY] = row
        return Sample(prompt=copy.deepcopy(p.prompt), label=copy.deepcopy(p.label), metadata=metadata)
