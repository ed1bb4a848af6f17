"""Image rewards: JPEG compressibility, the shapes classifier's alignment, a custom reward by import path."""

import pytest
import torch

from verst.data import shapes
from verst.rewards.image import ShapeClassifier, jpeg_compressibility, load_image_reward


def test_flat_images_compress_better_than_noise():
    flat = torch.zeros(2, 3, 16, 16)
    noise = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert (jpeg_compressibility(flat) > jpeg_compressibility(noise)).all()


def test_the_classifier_learns_the_shapes_and_scores_alignment(tmp_path):
    images, labels = (torch.tensor(a) for a in shapes.dataset(900, seed=0))
    classifier = ShapeClassifier(shapes.N_CLASSES)
    classifier.fit(images, labels, steps=400)
    held, held_labels = (torch.tensor(a) for a in shapes.dataset(180, seed=9))
    assert classifier.accuracy(held, held_labels) > 0.8
    right = classifier.alignment(held, held_labels)
    wrong = classifier.alignment(held, (held_labels + 1) % shapes.N_CLASSES)
    assert right.mean() > wrong.mean() + 0.5
    classifier.save(tmp_path / "clf.pt")
    assert torch.equal(ShapeClassifier.load(tmp_path / "clf.pt").alignment(held, held_labels), right)


def brightness(images, labels):
    return images.mean(dim=(1, 2, 3))


def test_a_custom_image_reward_loads_by_import_path():
    fn = load_image_reward(f"{__name__}:brightness")
    assert fn(torch.ones(2, 3, 4, 4), torch.zeros(2)).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="not 'module:function'"):
        load_image_reward("no_colon")
    with pytest.raises(ValueError, match="no callable 'missing'"):
        load_image_reward(f"{__name__}:missing")
