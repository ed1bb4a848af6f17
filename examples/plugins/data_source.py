"""A data source factory (`data.source`): called with the run's `DataConfig`, it returns an object with the
`verst.data.DataSource` methods. This one makes multiplication prompts in memory instead of reading a file.

    [data]
    source = "examples.plugins.data_source:times_tables"
"""

from __future__ import annotations

from verst.config import DataConfig
from verst.data import PromptSource
from verst.types import Sample


def times_tables(cfg: DataConfig) -> PromptSource:
    """Every product of two numbers from 2 to 12 as a prompt `"7*8="` with the label `"56"`."""
    prompts = [Sample(prompt=f"{a}*{b}=", label=str(a * b)) for a in range(2, 13) for b in range(2, 13)]
    # PromptSource brings the seeded per-epoch order, returned prompts and a resumable position.
    return PromptSource(prompts, shuffle=cfg.shuffle, seed=cfg.seed)
