"""A float32 array as JSON: base64 of its C-order bytes with its shape (an exact round trip). The diffusion
engine's replies carry images and latents this way, and an image trajectory's `Sample.latents` keeps them so."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

DTYPE = "float32"


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """{"data": base64 of the float32 C-order bytes, "shape", "dtype"}."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return {"data": base64.b64encode(array.tobytes()).decode("ascii"), "shape": list(array.shape), "dtype": DTYPE}


def decode_array(encoded: dict[str, Any], field: str = "array") -> np.ndarray:
    """The array of `encode_array`'s dict (a writable copy); a ValueError naming `field` otherwise."""
    try:
        raw = base64.b64decode(encoded["data"], validate=True)
        shape = [int(d) for d in encoded["shape"]]
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise ValueError(f"{field}: not a base64 float32 array with its shape ({exc})") from None
    if encoded.get("dtype", DTYPE) != DTYPE or len(raw) != 4 * int(np.prod(shape)):
        raise ValueError(f"{field}: {len(raw)} bytes do not hold a {DTYPE} array of shape {shape}")
    return np.frombuffer(raw, dtype=np.float32).reshape(shape).copy()
