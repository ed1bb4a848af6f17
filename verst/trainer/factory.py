"""The backend factory a torch-free driver hands the trainer ranks: `functools.partial(fsdp2_backend, ...)`
is pickled by reference, and the ranks import the backend (and torch) when they call it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verst.config.imports import import_plugins
from verst.trainer.backend import TrainBackend


def fsdp2_backend(*args: Any, plugins: Sequence[str] = (), **kwargs: Any) -> TrainBackend:
    """`FSDP2Backend(*args, **kwargs)`, imported when called: a factory a torch-free driver hands the
    ranks (`functools.partial(fsdp2_backend, model_cfg, trainer_cfg, ...)`), which import torch there. The
    config's `plugins` are imported first: the names they register are looked up in the ranks."""
    from verst.trainer.fsdp import FSDP2Backend

    import_plugins(list(plugins))
    return FSDP2Backend(*args, **kwargs)


def diffusion_backend(*args: Any, plugins: Sequence[str] = (), **kwargs: Any) -> TrainBackend:
    """`DiffusionBackend(*args, **kwargs)`, imported when called, as `fsdp2_backend` (model.kind = 'diffusion')."""
    from verst.trainer.diffusion_backend import DiffusionBackend

    import_plugins(list(plugins))
    return DiffusionBackend(*args, **kwargs)
