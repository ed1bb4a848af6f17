"""Layer 1: prompt datasets (JSONL, Parquet), the resumable prompt source, and procedural tasks.

No chat template here: prompts stay text or chat messages until the rollout edge renders them.
"""

from verst.data.loading import (
    DATA_INDEX_KEY,
    DataError,
    PromptKeys,
    held_out_prompts,
    load_prompts,
    load_prompts_from_config,
    row_to_sample,
)
from verst.data.source import DataSource, PromptSource
from verst.data.tasks import TASKS, Problem, make_splits, write_jsonl

__all__ = [
    "DATA_INDEX_KEY",
    "TASKS",
    "DataError",
    "DataSource",
    "Problem",
    "PromptKeys",
    "PromptSource",
    "held_out_prompts",
    "load_prompts",
    "load_prompts_from_config",
    "make_splits",
    "row_to_sample",
    "write_jsonl",
]
