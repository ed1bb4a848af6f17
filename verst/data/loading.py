"""Read prompt datasets (JSONL, Parquet) into prompt `Sample`s with configurable column names.

Prompts stay as given (text or chat messages); chat templates are applied later, at the rollout edge.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.config import DataConfig, VerstConfig
from verst.types import Sample

# The data source stamps every prompt it serves with its row number under this metadata key, so a
# returned prompt can be found again whatever the rollout added to the sample since.
DATA_INDEX_KEY = "data_index"


class DataError(ValueError):
    """A dataset or one of its rows is unusable; the message names the file, row and key."""


@dataclass(frozen=True)
class PromptKeys:
    """Which column holds what; `None` means the dataset has no such column."""

    prompt: str = "prompt"
    label: str | None = "label"
    metadata: str | None = "metadata"
    tools: str | None = "tools"

    @classmethod
    def from_config(cls, cfg: DataConfig) -> PromptKeys:
        return cls(prompt=cfg.prompt_key, label=cfg.label_key, metadata=cfg.metadata_key, tools=cfg.tools_key)


def detect_format(path: str | Path, fmt: str = "auto") -> str:
    """'jsonl' or 'parquet': `fmt` itself, or picked by the file extension when `fmt` is 'auto'."""
    if fmt in ("jsonl", "parquet"):
        return fmt
    if fmt != "auto":
        raise DataError(f"data.format = {fmt!r}: expected 'auto', 'jsonl' or 'parquet'")
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DataError(f"{path}: cannot tell the format from extension {suffix!r}; set data.format to 'jsonl' or 'parquet'")


def load_prompts(path: str | Path, keys: PromptKeys = PromptKeys(), fmt: str = "auto") -> list[Sample]:
    """Every row of `path` as a prompt Sample (`prompt`, `label`, `metadata`; tools in metadata['tools'])."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prompt file not found")
    fmt = detect_format(path, fmt)
    rows = _jsonl_rows(path) if fmt == "jsonl" else _parquet_rows(path, keys)
    prompts = [row_to_sample(row, keys, where) for where, row in rows]
    if not prompts:
        raise DataError(f"{path}: no prompts in the file")
    return prompts


def load_prompts_from_config(cfg: DataConfig, split: str = "train") -> list[Sample]:
    """The train or test prompts named by a DataConfig."""
    if split not in ("train", "test"):
        raise DataError(f"split {split!r}: expected 'train' or 'test'")
    path = cfg.train_path if split == "train" else cfg.test_path
    if path is None:
        raise DataError(f"data.{split}_path is not set")
    return load_prompts(path, PromptKeys.from_config(cfg), cfg.format)


def held_out_prompts(cfg: VerstConfig, dataset: str | None = None) -> list[Sample]:
    """The run's held-out prompts (`dataset`, else eval.path, else data.test_path), `eval.max_prompts` of them."""
    path = dataset or cfg.eval.path or cfg.data.test_path
    if path is None:
        raise ValueError("evaluation needs eval.path or data.test_path (or a dataset)")
    data = cfg.data.model_copy(update={"test_path": str(path)})
    return load_prompts_from_config(data, "test")[: cfg.eval.max_prompts]


def row_to_sample(row: Any, keys: PromptKeys, where: str) -> Sample:
    """One dataset row as a prompt Sample; `where` ('FILE line N') prefixes every error."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be an object, got {type(row).__name__}")
    if keys.prompt not in row:
        raise DataError(f"{where}: missing prompt key {keys.prompt!r} (row keys: {sorted(row)})")
    prompt = _check_prompt(row[keys.prompt], where, keys.prompt)
    label = None
    if keys.label is not None:
        if row.get(keys.label) is None:
            found = "null" if keys.label in row else f"missing (row keys: {sorted(row)})"
            raise DataError(
                f"{where}: label key {keys.label!r} is {found}; set data.label_key to null for unlabelled prompts"
            )
        label = row[keys.label]
    metadata = dict(_optional_json(row, keys.metadata, dict, where) or {})
    if DATA_INDEX_KEY in metadata:
        raise DataError(f"{where}: metadata key {DATA_INDEX_KEY!r} is reserved for the data source's row number")
    tools = _optional_json(row, keys.tools, list, where)
    if tools is not None:
        metadata["tools"] = tools
    return Sample(prompt=prompt, label=label, metadata=metadata)


def _check_prompt(prompt: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: key {key!r} must be a string or a non-empty list of chat messages, got {prompt!r:.80}")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise DataError(f"{where}: key {key!r}: message {i} must be an object with 'role' and 'content', got {message!r:.80}")
    return prompt


def _optional_json(row: dict, key: str | None, kind: type, where: str) -> Any:
    """An optional dict/list column; Parquet datasets often store these as JSON strings, decoded here."""
    if key is None or row.get(key) is None:
        return None
    value = row[key]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: key {key!r} is a string that is not JSON ({e})") from None
    if not isinstance(value, kind):
        raise DataError(f"{where}: key {key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e})") from None


def _parquet_rows(path: Path, keys: PromptKeys) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # lazy: only Parquet users pay for the import

    file = pq.ParquetFile(path)
    names = set(file.schema_arrow.names)
    if keys.prompt not in names:
        raise DataError(f"{path}: missing prompt key {keys.prompt!r} (columns: {sorted(names)})")
    wanted = [k for k in (keys.prompt, keys.label, keys.metadata, keys.tools) if k is not None and k in names]
    number = 0
    for batch in file.iter_batches(columns=wanted):
        for row in batch.to_pylist():
            yield f"{path} row {number}", row
            number += 1
