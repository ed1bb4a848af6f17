"""`verst serve`: filled in by a later issue; until then it says so and exits non-zero."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print("usage: verst serve ...  (not built yet)")
        return 0
    raise SystemExit("verst serve: not built yet")
