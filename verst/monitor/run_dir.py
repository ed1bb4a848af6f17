"""The run directory: resolved config, metrics.jsonl and summary.json of one run."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from verst.config import VerstConfig

log = logging.getLogger(__name__)
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def run_dir_of(cfg: VerstConfig) -> Path:
    return Path(cfg.run_dir) if cfg.run_dir else Path("runs") / cfg.name


class RunDirError(ValueError):
    """The run directory cannot be used as the config asks; the message says how to go on."""


def check_run_dir(cfg: VerstConfig) -> Path:
    """The run directory, refused when it holds another run's files and `overwrite` is off: metrics
    would append to that run's and its config and summary would be replaced. A run resuming from a
    checkpoint of this run directory (`checkpoint.load`) continues in it."""
    path = run_dir_of(cfg)
    if resumes_here(cfg):
        return path
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run_dir {str(path)!r} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not cfg.overwrite:
        raise RunDirError(
            f"run directory {str(path)!r} already holds a run (from name = {cfg.name!r} or run_dir); "
            "pick another --name or --run-dir, or pass --overwrite to empty it first")
    return path


def resumes_here(cfg: VerstConfig) -> bool:
    """Whether `checkpoint.load` names this run directory or a checkpoint inside it."""
    if not cfg.checkpoint.load:
        return False
    run_dir, load = run_dir_of(cfg).resolve(), Path(cfg.checkpoint.load).resolve()
    return load == run_dir or run_dir in load.parents


def prepare_run_dir(cfg: VerstConfig, tables: dict[str, dict[str, Any]] | None = None) -> Path:
    """Create the run directory (emptied first with `overwrite`) and write the resolved config into it, with
    `tables` (settings outside `VerstConfig` that the run's command reads from the same file, e.g. `sim`) after it."""
    path = check_run_dir(cfg)
    if cfg.overwrite and path.is_dir() and not resumes_here(cfg):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_dump(mode="json")
    clashing = sorted(set(tables or {}) & set(resolved))
    if clashing:
        raise ValueError(f"tables {clashing} would replace config sections of the same name")
    (path / CONFIG_FILE).write_text(yaml.safe_dump({**resolved, **(tables or {})}, sort_keys=False))
    return path


def write_summary(path: Path, summary: dict[str, Any]) -> Path:
    """RUN/summary.json, replaced whole (a full disk leaves the previous one, not half a file)."""
    out = Path(path) / SUMMARY_FILE
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        tmp.write_text(json.dumps(_json_safe(summary), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl, in order. A last line cut short (a run stopped, or a disk that
    filled, while it was written) is left out with a warning; a bad line before it is an error."""
    file = Path(path) / METRICS_FILE
    if not file.exists():
        return []
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number < len(lines):
                raise ValueError(f"{file}, line {number}: not a JSON record ({error})") from None
            log.warning("%s: its last line is cut short (%d characters; the run stopped while writing it); "
                        "left out", file, len(line))
    return records


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
