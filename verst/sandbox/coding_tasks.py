"""Terminal-use coding tasks from templates, seeded, with held-out splits, graded in a sandbox.

A task is a few files of a small Python project plus a test file; `solution` holds the files that solve it
(what a scripted teacher writes) and `clues` the files a solver must read to write it. Two families:
"operations" (fix or write `add`, `multiply`, `subtract`, held out: `maximum`: the name says what to write)
and "operators" (a function such as `blend(a, b)` applies the wrong operator; only the test says the right one,
so a solver reads it; held out: bugs the train split never has). The visible tests run in the sandbox by a
small runner with the system interpreter (no pytest needed inside), which prints `PASSED k/n`. The grade is the
fraction of the task's hidden checks that pass: each a command whose output's last line must equal an expected
value, which never enters the workspace and is compared outside the sandbox. Code the model wrote runs in the same
process as the runner and could print any verdict line; to pass a hidden check it has to compute the answer.
"""

import hashlib
import operator
import random
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from verst.sandbox.base import Sandbox

RUNNER = """import importlib, sys, traceback
sys.dont_write_bytecode = True
sys.path.insert(0, '.')
tests = importlib.import_module('test_project')
names = [n for n in dir(tests) if n.startswith('test_')]
passed = 0
for name in names:
    try:
        getattr(tests, name)(); passed += 1
    except Exception:
        traceback.print_exc(limit=1)
print(f'PASSED {passed}/{len(names)}')
"""

PYTHON = "/usr/bin/python3 -B"
TEST_COMMAND = f"{PYTHON} run_tests.py"

OPERATIONS = {"add": ("a + b", "a - b"), "multiply": ("a * b", "a + b"), "subtract": ("a - b", "a + b"),
              "maximum": ("a if a > b else b", "a if a < b else b")}


@dataclass(frozen=True)
class Check:
    """A hidden check: `command` run in the workspace, passing when its output's last line is `expected`."""

    command: str
    expected: str

    def to_dict(self) -> dict[str, str]:
        return {"command": self.command, "expected": self.expected}


@dataclass(frozen=True)
class CodingTask:
    name: str
    kind: str  # "fix" (a bug to fix) or "write" (a function to write)
    prompt: str
    files: dict[str, str]
    solution: dict[str, str]
    checks: tuple[Check, ...] = field(default=())  # the grade; none: the visible tests' fraction
    clues: tuple[str, ...] = ()  # the files that say what the solution is; none: the solution's own files
    function: str = ""  # the function the task is about

    @property
    def files_to_read(self) -> tuple[str, ...]:
        return self.clues or tuple(self.solution)


def reference(op: str, a: int, b: int) -> int:
    return {"add": a + b, "multiply": a * b, "subtract": a - b, "maximum": max(a, b)}[op]


def make_task(op: str, kind: str, rng: random.Random) -> CodingTask:
    right, wrong = OPERATIONS[op]
    cases = [(rng.randint(-9, 9), rng.randint(-9, 9)) for _ in range(4)]
    tests = "from project import " + op + "\n\n" + "".join(
        f"\ndef test_{op}_{i}():\n    assert {op}({a}, {b}) == {reference(op, a, b)}\n" for i, (a, b) in enumerate(cases))
    solved = f"def {op}(a, b):\n    return {right}\n"
    broken = f"def {op}(a, b):\n    return {wrong}\n" if kind == "fix" else f"def {op}(a, b):\n    raise NotImplementedError\n"
    verb = "Fix the bug in" if kind == "fix" else "Write"
    name = f"{kind}-{op}-{hashlib.sha1(tests.encode()).hexdigest()[:8]}"
    return CodingTask(name, kind, f"{verb} `{op}(a, b)` in project.py so that the tests in test_project.py pass.",
                      {"project.py": broken, "test_project.py": tests, "run_tests.py": RUNNER}, {"project.py": solved},
                      hidden_checks(op, random.Random(name)), function=op)


def hidden_checks(op: str, rng: random.Random, count: int = 4) -> tuple[Check, ...]:
    """`count` calls of `op` on inputs wider than the visible tests', each printing its result's repr."""
    cases = [(rng.randint(-99, 99), rng.randint(-99, 99)) for _ in range(count)]
    code = "import sys; sys.path.insert(0, '.'); from project import {op}; print(repr({op}({a}, {b})))"
    return tuple(Check(f"{PYTHON} -c {shlex.quote(code.format(op=op, a=a, b=b))}", repr(reference(op, a, b)))
                 for a, b in cases)


OPERATOR_FUNCTIONS = ("blend", "combine", "merge", "mix", "fold", "join", "pair", "fuse", "apply", "step", "link",
                      "fit")
OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "%": operator.mod}


def make_operator_task(name: str, wrong: str, right: str, rng: random.Random) -> CodingTask:
    """`name(a, b)` in project.py applies `wrong`; the test's expected value is written as the expression with
    `right`, which only the test file says (the name does not)."""
    a, b = rng.randint(11, 99), rng.randint(2, 9)
    tests = f"from project import {name}\n\n\ndef test_{name}():\n    assert {name}({a}, {b}) == {a} {right} {b}\n"
    code = "import sys; sys.path.insert(0, '.'); from project import {name}; print(repr({name}({a}, {b})))"
    cases = [(rng.randint(10, 99), rng.randint(2, 9)) for _ in range(2)]
    checks = tuple(Check(f"{PYTHON} -c {shlex.quote(code.format(name=name, a=x, b=y))}",
                         repr(OPERATORS[right](x, y)))
                   for x, y in cases)
    return CodingTask(f"fix-{name}-{hashlib.sha1(tests.encode()).hexdigest()[:8]}", "fix", f"Fix the bug in `{name}(a, b)` in project.py so that "
                      "the tests pass.", {"project.py": f"def {name}(a, b):\n    return a {wrong} b\n",
                                          "test_project.py": tests, "run_tests.py": RUNNER},
                      {"project.py": f"def {name}(a, b):\n    return a {right} b\n"}, checks,
                      clues=("test_project.py",), function=name)


def operator_tasks(split: str, count: int, seed: int) -> list[CodingTask]:
    """A (name, wrong, right) triple is in the held-out split when its hash is, so no held-out bug is trained on."""
    rng = random.Random(f"operators:{split}:{seed}")
    tasks: list[CodingTask] = []
    while len(tasks) < count:
        name, wrong, right = rng.choice(OPERATOR_FUNCTIONS), rng.choice(list(OPERATORS)), rng.choice(list(OPERATORS))
        heldout = int(hashlib.sha1(f"{name}:{wrong}:{right}".encode()).hexdigest(), 16) % 5 == 0
        if wrong != right and heldout == (split == "heldout"):
            tasks.append(make_operator_task(name, wrong, right, rng))
    return tasks


FAMILIES = ("operations", "operators")
FAMILY_FUNCTIONS = {"operations": tuple(OPERATIONS), "operators": OPERATOR_FUNCTIONS}  # the functions tasks are on


def generate(split: str, count: int, seed: int = 0, family: str = "operations") -> list[CodingTask]:
    """`count` tasks of a split of a family. operations: "train" uses add, multiply and subtract; "heldout" holds
    maximum out. operators: "heldout" holds a fifth of the (name, wrong, right) triples out."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}: expected 'train' or 'heldout'")
    if family == "operators":
        return operator_tasks(split, count, seed)
    if family != "operations":
        raise ValueError(f"unknown task family {family!r}: expected one of {', '.join(FAMILIES)}")
    ops = {"train": ["add", "multiply", "subtract"], "heldout": ["maximum"]}[split]
    rng = random.Random(f"{split}:{seed}")
    return [make_task(rng.choice(ops), rng.choice(["fix", "write"]), rng) for _ in range(count)]


@dataclass(frozen=True)
class TestReport:
    """One run of a task's tests or checks: how many passed of how many, and the output (capped)."""

    passed: int
    total: int
    output: str

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def run_tests(sandbox: Sandbox, timeout_s: float = 20) -> TestReport:
    """The task's tests run in the sandbox as it is now; output without a last `PASSED k/n` line counts 0/0."""
    result = sandbox.exec(TEST_COMMAND, timeout_s)
    last = result.output.strip().splitlines()[-1] if result.output.strip() else ""
    if not last.startswith("PASSED "):
        return TestReport(0, 0, result.output)
    passed, total = (int(n) for n in last.removeprefix("PASSED ").split("/"))
    return TestReport(passed, total, result.output)


def run_checks(sandbox: Sandbox, checks: Sequence[Check], timeout_s: float = 10) -> TestReport:
    """Each hidden check run in the sandbox as it is now; the output names the ones that failed."""
    failed = []
    for index, check in enumerate(checks):
        result = sandbox.exec(check.command, timeout_s)
        lines = result.output.strip().splitlines()
        if result.exit_code != 0 or not lines or lines[-1].strip() != check.expected:
            failed.append(f"check {index}: exit code {result.exit_code}, last line {lines[-1] if lines else ''!r:.80}")
    return TestReport(len(checks) - len(failed), len(checks), "\n".join(failed))


def grade(sandbox: Sandbox, checks: Sequence[Check] = (), timeout_s: float = 20) -> float:
    """The fraction of the hidden checks that pass in the sandbox as it is now; without checks, of the tests."""
    return run_checks(sandbox, checks).fraction if checks else run_tests(sandbox, timeout_s).fraction
