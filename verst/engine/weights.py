"""The engine's third weight source besides the wire formats of `verst.inference_client.weights`: a
safetensors checkpoint directory on disk (`update_weights_from_disk`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from verst.inference_client.protocol import InvalidRequest


def read_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a checkpoint directory (HF save_pretrained layout)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path)
    try:
        if not directory.is_dir():
            raise InvalidRequest("model_path", str(path), "not a directory")
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise InvalidRequest("model_path", str(path), "holds no *.safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
    except InvalidRequest:
        raise
    except (OSError, ValueError, SafetensorError) as exc:  # unreadable, a NUL in the path, a corrupt file
        raise InvalidRequest("model_path", str(path), f"cannot be read ({type(exc).__name__}: {exc})") from None
    return tensors
