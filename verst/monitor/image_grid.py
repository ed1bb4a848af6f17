"""Image grids for the report and the diffusion commands: images in rows of `columns`, as one enlarged PNG."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import numpy as np

EVAL_GRID_DIR = "eval_images"  # in a run directory: step_<version>.png per held-out evaluation of an image run
_STEP = re.compile(r"step_(\d+)\.png$")


def to_pixels(images: np.ndarray) -> np.ndarray:
    """(N, 3, H, W) float in [-1, 1] -> (N, H, W, 3) uint8."""
    return ((np.clip(images, -1, 1) + 1) * 127.5).round().astype(np.uint8).transpose(0, 2, 3, 1)


def save_grid(pixels: np.ndarray, path: str | Path, columns: int, scale: int = 4) -> Path:
    """(N, H, W, 3) uint8, row by row, as a PNG enlarged `scale` times -> its path."""
    from PIL import Image

    n, h, w, _ = pixels.shape
    if n % columns:
        raise ValueError(f"{n} images do not fill rows of {columns} columns")
    rows = n // columns
    sheet = pixels.reshape(rows, columns, h, w, 3).transpose(0, 2, 1, 3, 4).reshape(rows * h, columns * w, 3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(sheet).resize((columns * w * scale, rows * h * scale), Image.NEAREST).save(path)
    return path


def eval_grid_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / EVAL_GRID_DIR / f"step_{step:05d}.png"


def eval_grids(run_dir: str | Path) -> dict[int, Path]:
    """{evaluated step: its grid} of a run directory, in step order."""
    found = {}
    for path in (Path(run_dir) / EVAL_GRID_DIR).glob("step_*.png"):
        match = _STEP.search(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def data_uri(path: Path) -> str:
    """A PNG as a data: URI, for a self-contained page."""
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")
