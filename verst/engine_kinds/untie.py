"""Checkpoint views with the output embedding spelled out, for vLLM on CPU.

vLLM-CPU packs each linear layer's weights for its GEMM kernels when they load; an in-place reload repacks
the layers whose weights it reads, but a tied `lm_head` reads none and keeps the old packed copy. So the
gateway serves tied checkpoints untied (`tie_word_embeddings` false, `lm_head.weight` a copy of the input
embedding): a view directory of links to the checkpoint's files plus one file holding `lm_head.weight`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

INDEX = "model.safetensors.index.json"
LM_HEAD_FILE = "verst-lm-head.safetensors"


def ties_embeddings(model: str | Path) -> bool:
    config = json.loads((Path(model) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False)))


def untied_view(model: str | Path, view: str | Path) -> Path:
    """`view`: every file of the checkpoint `model` linked, plus `lm_head.weight` (the input embedding)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, view = Path(model).resolve(), Path(view)
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    embedding = None
    for path in sorted(model.iterdir()):
        if path.is_file() and path.name != INDEX:
            (view / path.name).symlink_to(path)
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                names = [k for k in f.keys() if k.endswith("embed_tokens.weight")]
                if names and embedding is None:
                    embedding = f.get_tensor(names[0])
    if embedding is None:
        raise ValueError(f"{model}: tie_word_embeddings is set, but no *embed_tokens.weight tensor is in its "
                         "safetensors files")
    save_file({"lm_head.weight": embedding.contiguous()}, str(view / LM_HEAD_FILE), metadata={"format": "pt"})
    if (model / INDEX).exists():
        index = json.loads((model / INDEX).read_text())
        index["weight_map"]["lm_head.weight"] = LM_HEAD_FILE
        (view / INDEX).write_text(json.dumps(index))
    return view


def with_untied_override(flags: list[str]) -> list[str]:
    """vLLM's flags with `tie_word_embeddings: false` merged into `--hf-overrides` (added when absent)."""
    flags = list(flags)
    for i, flag in enumerate(flags):
        name, eq, value = flag.partition("=")
        if name in ("--hf-overrides", "--hf_overrides"):
            if eq:
                merged = {**json.loads(value), "tie_word_embeddings": False}
                flags[i] = f"{name}={json.dumps(merged)}"
            else:
                flags[i + 1] = json.dumps({**json.loads(flags[i + 1]), "tie_word_embeddings": False})
            return flags
    return [*flags, "--hf-overrides", json.dumps({"tie_word_embeddings": False})]
