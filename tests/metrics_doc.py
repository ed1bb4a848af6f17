"""docs/metrics.md as a checkable list: every key a run logs must be documented there."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
ENVELOPE = {"step", "time"}


def documented_patterns() -> list[re.Pattern]:
    """Each backticked key in the doc's tables; `<name>` matches one path segment or more."""
    keys = re.findall(r"`([a-z]+/[^`]+)`", DOC.read_text())
    return [re.compile(_pattern(k)) for k in keys]


ADAPTER_KEY = re.compile(r"^lora/[^/]+/(.+)$")  # multi-LoRA: a documented key under its adapter's name
CATCH_ALL = "lora/<name>/<key>"


def undocumented(records: list[dict]) -> list[str]:
    """Keys no row documents. `lora/<name>/<key>` stands for the documented keys under an adapter's name,
    so such a key is checked by the key it carries."""
    patterns = [p for p in documented_patterns() if p.pattern != _pattern(CATCH_ALL)]
    keys = {k for r in records for k in r} - ENVELOPE

    def known(key: str) -> bool:
        inner = ADAPTER_KEY.match(key)
        return any(p.match(key) or (inner and p.match(inner.group(1))) for p in patterns)

    return sorted(k for k in keys if not known(k))


def _pattern(key: str) -> str:
    return re.sub(r"<[^>]+>", r"[^ ]+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">")) + "$"
