"""A procedurally drawn image dataset: coloured shapes on a dark background, each with its description.

Every image shows one shape (circle, square, triangle) in one colour (red, green, blue); its class is
`colour_index * len(SHAPES) + shape_index` and its description "red circle". Images are float32 arrays
(3, size, size) in [-1, 1], drawn with numpy from a seed, so the same seed draws the same images.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

COLOURS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.1), "blue": (0.15, 0.3, 1.0)}
SHAPES = ("circle", "square", "triangle")
N_CLASSES = len(COLOURS) * len(SHAPES)


def describe(label: int) -> str:
    """Class index -> its description, e.g. 0 -> "red circle"."""
    if not 0 <= label < N_CLASSES:
        raise ValueError(f"shape class {label} is outside [0, {N_CLASSES})")
    colour, shape = divmod(label, len(SHAPES))
    return f"{list(COLOURS)[colour]} {SHAPES[shape]}"


def label_of(description: str) -> int:
    """A description ("red circle") -> its class index; an unknown one is an error naming it."""
    parts = description.strip().lower().split()
    if len(parts) != 2 or parts[0] not in COLOURS or parts[1] not in SHAPES:
        raise ValueError(f"{description!r} is not '<colour> <shape>' with colour in {list(COLOURS)} "
                         f"and shape in {list(SHAPES)}")
    return list(COLOURS).index(parts[0]) * len(SHAPES) + SHAPES.index(parts[1])


def write_prompts(directory: str | Path, repeat: int = 8) -> tuple[Path, Path]:
    """An RL run's prompt files: train.jsonl with every class description `repeat` times, test.jsonl with each
    once ({"prompt": "red circle", "label": 0}) -> their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"prompt": describe(label), "label": label}) + "\n" for label in range(N_CLASSES)]
    train, test = directory / "train.jsonl", directory / "test.jsonl"
    train.write_text("".join(rows * repeat))
    test.write_text("".join(rows))
    return train, test


def draw(label: int, rng: np.random.Generator, size: int = 16) -> np.ndarray:
    """One image of class `label` with a random centre and radius -> float32 (3, size, size) in [-1, 1]."""
    colour, shape = divmod(label, len(SHAPES))
    radius = rng.uniform(0.22, 0.34) * size
    cx, cy = rng.uniform(radius, size - radius, size=2)
    ys, xs = np.mgrid[0:size, 0:size] + 0.5
    dx, dy = xs - cx, ys - cy
    if SHAPES[shape] == "circle":
        mask = dx**2 + dy**2 <= radius**2
    elif SHAPES[shape] == "square":
        mask = (np.abs(dx) <= radius * 0.85) & (np.abs(dy) <= radius * 0.85)
    else:  # an upward triangle: below the apex, inside both slanted sides
        mask = (dy >= -radius) & (dy <= radius) & (np.abs(dx) <= (dy + radius) * 0.6)
    rgb = np.asarray(list(COLOURS.values())[colour], dtype=np.float32)
    image = np.full((3, size, size), 0.05, dtype=np.float32)
    image[:, mask] = rgb[:, None]
    return image * 2.0 - 1.0


def dataset(n: int, seed: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """`n` images with balanced classes -> (images float32 (n, 3, size, size), labels int64 (n,))."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % N_CLASSES
    rng.shuffle(labels)
    images = np.stack([draw(int(label), rng, size) for label in labels])
    return images, labels.astype(np.int64)
