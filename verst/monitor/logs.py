"""verst's library logs (`logging.getLogger(__name__)` in every module) on a terminal: one line each,
tagged with the module (`[run.start] started in 6.2 s (...)`), on stderr. Entry points (the CLI, the engine
server, the demos) call `configure_logging`; a library user configures `logging` as they like.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

ROOT = "verst"
_HANDLER_NAME = "verst-console"


class _TagFormatter(logging.Formatter):
    """`[module] message`: the logger's name below `verst.`; warnings and errors say so."""

    def format(self, record: logging.LogRecord) -> str:
        tag = record.name.removeprefix(f"{ROOT}.")
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"[{tag}] {level}{record.getMessage()}" + (
            f"\n{self.formatException(record.exc_info)}" if record.exc_info else "")


class _StderrHandler(logging.StreamHandler):
    """Writes to `sys.stderr` as it is when a record comes (it may be replaced after the handler is made, by a
    test's capture or a redirection, and the old one closed)."""

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def configure_logging(level: int = logging.INFO, stream: TextIO | None = None) -> logging.Logger:
    """Send the `verst` loggers' records at `level` and above to `stream` (stderr), once per process: a second
    call only sets the level. Other libraries' loggers are left as they are."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(_TagFormatter())
        logger.addHandler(handler)
    return logger
