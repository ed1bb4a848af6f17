"""The engine's third weight source besides the wire formats of `verst.inference_client.weights`: a
safetensors checkpoint directory on disk (`update_weights_from_disk`), read one file at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from verst.inference_client.protocol import InvalidRequest


def safetensors_files(path: str | Path) -> list[Path]:
    """Every *.safetensors file of a checkpoint directory (HF save_pretrained layout)."""
    directory = Path(path)
    try:
        if not directory.is_dir():
            raise InvalidRequest("model_path", str(path), "not a directory")
        files = sorted(directory.glob("*.safetensors"))
    except (OSError, ValueError) as exc:  # unreadable, a NUL in the path
        raise InvalidRequest("model_path", str(path), f"cannot be read ({type(exc).__name__}: {exc})") from None
    if not files:
        raise InvalidRequest("model_path", str(path), "holds no *.safetensors files")
    return files


def safetensors_shapes(files: list[Path]) -> list[tuple[str, list[int]]]:
    """(name, shape) of every tensor of the files, from their headers (no tensor data is read)."""
    from safetensors import SafetensorError, safe_open

    shapes = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                shapes += [(name, f.get_slice(name).get_shape()) for name in f.keys()]
        except (OSError, ValueError, SafetensorError) as exc:  # unreadable or corrupt
            raise InvalidRequest("model_path", str(file), f"cannot be read ({type(exc).__name__}: {exc})") from None
    return shapes


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the files, one file at a time: `load_file` maps a file and its tensors are views of
    the mapping, so the copy into a parameter is the only read and one file is mapped at a time."""
    from safetensors.torch import load_file

    for file in files:
        yield from load_file(str(file)).items()


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a checkpoint directory."""
    files = safetensors_files(path)
    safetensors_shapes(files)  # a corrupt or unreadable file is refused by name before any tensor is read
    return dict(iter_safetensors(files))


def copy_weights(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]],
                 shapes: list[tuple[str, Any]] | None = None) -> int:
    """Copy tensors into `model` by name, every name and shape checked first (`check_weight_names`); how many.
    With `shapes` (every name and shape `named` will yield), `named` may be lazy: it is read once, each tensor
    copied as it comes (a checkpoint read a file at a time)."""
    items = named if shapes is not None else list(named)
    table = check_weight_names(model, shapes if shapes is not None else [(name, t.shape) for name, t in items])
    count = 0
    with torch.no_grad():
        for name, tensor in items:
            table[name].copy_(tensor)
            count += 1
    return count


def check_weight_names(model: torch.nn.Module, named_shapes: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Every name must be a weight of `model` with the same shape; returns the model's tensors by name."""
    table = model.state_dict(keep_vars=True)
    for name, shape in named_shapes:
        if name not in table:
            known = ", ".join(list(table)[:3])
            raise InvalidRequest("names", name, f"not a weight of the model (e.g. {known}, ...)")
        if tuple(shape) != tuple(table[name].shape):
            raise InvalidRequest("shapes", list(shape), f"{name} has shape {list(table[name].shape)} in the model")
    return table
