"""docs/metrics.md as a checkable list: every key a run logs must be documented there."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
ENVELOPE = {"step", "time"}


def documented_patterns() -> list[re.Pattern]:
    """Each backticked key in the doc's tables; `<name>` matches one path segment or more."""
    keys = re.findall(r"`([a-z]+/[^`]+)`", DOC.read_text())
    return [re.compile(re.sub(r"<[^>]+>", r"[^ ]+", re.escape(k).replace(r"\<", "<").replace(r"\>", ">")) + "$")
            for k in keys]


def undocumented(records: list[dict]) -> list[str]:
    patterns = documented_patterns()
    keys = {k for r in records for k in r} - ENVELOPE
    return sorted(k for k in keys if not any(p.match(k) for p in patterns))
