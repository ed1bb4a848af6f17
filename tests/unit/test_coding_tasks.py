"""Templated coding tasks: seeded, split, and graded in a bubblewrap sandbox by their tests and hidden checks; the
teacher's solution passes; a project that prints the runner's verdict itself passes no hidden check."""

import pytest

from verst.sandbox import BubblewrapProvider
from verst.sandbox.coding_tasks import generate, grade, run_checks, run_tests


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


def test_hidden_checks_grade_and_cannot_be_passed_by_printing_a_verdict():
    provider = BubblewrapProvider()
    task = generate("train", 1, seed=5)[0]
    assert len(task.checks) == 4 and all(check.expected not in str(task.files) for check in task.checks)
    box = provider.start(task.files)
    try:
        for path, text in task.solution.items():
            box.write_file(path, text)
        assert grade(box, task.checks) == 1.0 and run_checks(box, task.checks).output == ""
        # a project that prints the runner's verdict and leaves before any test runs
        box.write_file("project.py", "import os\nprint('PASSED 4/4', flush=True)\nos._exit(0)\n")
        assert run_tests(box).fraction == 1.0  # the runner's line is fooled
        report = run_checks(box, task.checks)
        assert (report.passed, report.total) == (0, 4) and "last line 'PASSED 4/4'" in report.output
        assert grade(box, task.checks) == 0.0
    finally:
        box.close()


def test_operator_tasks_say_the_right_operator_only_in_their_tests():
    assert generate("train", 5, seed=1, family="operators") == generate("train", 5, seed=1, family="operators")
    bug = lambda task: (task.files["project.py"], task.solution["project.py"])  # noqa: E731
    train = {bug(t) for t in generate("train", 300, family="operators")}
    heldout = {bug(t) for t in generate("heldout", 60, family="operators")}
    assert len(heldout) > 5 and not train & heldout  # no held-out bug is trained on
    provider = BubblewrapProvider()
    for task in generate("heldout", 3, seed=3, family="operators"):
        right = task.solution["project.py"].split("return a ")[1].split(" b")[0]
        assert task.clues == ("test_project.py",) and f" {right} " in task.files["test_project.py"].split("==")[1]
        assert f" {right} " not in task.files["project.py"] + task.prompt
        box = provider.start(task.files)
        try:
            assert grade(box, task.checks) == 0.0 and run_tests(box).fraction == 0.0
            box.write_file("project.py", task.solution["project.py"])
            assert grade(box, task.checks) == 1.0 and run_tests(box).fraction == 1.0
        finally:
            box.close()


def test_an_unknown_family_is_refused_by_name():
    with pytest.raises(ValueError, match="'recipes'.*operations, operators"):
        generate("train", 1, family="recipes")
