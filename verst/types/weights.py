"""`WeightBucket`: the unit of weight sync that trainer backends yield and weight transports push. A type
alias only; torch is named for type checkers and never imported here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# One bucket of full (unsharded), Hugging Face-named tensors.
WeightBucket = list[tuple[str, "torch.Tensor"]]
