"""The benches' `--model` option: `smollm2` (SmolLM2-135M-Instruct, from $VERST_SMOLLM2 or converted once
into the user's cache, as the slow tests get it) or the path of any Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

KNOWN = ("smollm2",)


def resolve_model(spec: str) -> Path:
    if spec == "smollm2":
        from tests.real_model import smollm2_checkpoint

        return smollm2_checkpoint()
    path = Path(spec)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {spec}: neither one of {KNOWN} nor a checkpoint directory with a config.json")
    return path
