"""Layer 1: metrics logging (jsonl, TensorBoard, W&B), run directories and reports."""

from verst.monitor.logger import MetricsLogger
from verst.monitor.run_dir import RunDirError, check_run_dir, prepare_run_dir, read_metrics, run_dir_of, write_summary

__all__ = [
    "MetricsLogger", "RunDirError", "check_run_dir", "prepare_run_dir", "read_metrics", "run_dir_of", "write_summary",
]
