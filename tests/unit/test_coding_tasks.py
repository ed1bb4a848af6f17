"""Templated coding tasks: seeded, split, and graded in a bubblewrap sandbox; the teacher's solution passes."""

import pytest

from verst.sandbox import BubblewrapProvider
from verst.sandbox.coding_tasks import generate, grade


def test_tasks_are_seeded_and_the_splits_disjoint():
    assert generate("train", 5, seed=1) == generate("train", 5, seed=1)
    assert generate("train", 5, seed=1) != generate("train", 5, seed=2)
    train = {t.name.split("-")[1] for t in generate("train", 30)}
    heldout = {t.name.split("-")[1] for t in generate("heldout", 10)}
    assert train and heldout and not train & heldout
    with pytest.raises(ValueError, match="'test'"):
        generate("test", 1)


def test_grade_is_the_fraction_of_tests_passing():
    provider = BubblewrapProvider()
    for task in generate("train", 2, seed=3) + generate("heldout", 1):
        box = provider.start(task.files)
        try:
            assert grade(box) == 0.0 or task.kind == "fix"
            for path, text in task.solution.items():
                box.write_file(path, text)
            assert grade(box) == 1.0
            box.write_file("project.py", task.solution["project.py"].replace("return", "return 0 and"))
            assert 0.0 <= grade(box) < 1.0
        finally:
            box.close()
