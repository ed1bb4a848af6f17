"""The layer order as a test: a package imports only packages at a strictly lower position.

Positions are (layer, sublayer). Layer 0 holds the record and the config, layer 1 algorithms, data and
models, layer 2 the running parts, layer 3 orchestration, layer 4 the run's parts, the schedules and the
command line. Inside layer 2:
  2.0 inference_client                    what every caller of an engine needs (client, wire, fleet)
  2.1 engine, engine_kinds, router, session, trainer, sync   each alone, on top of the client (sync hands the
      trainer's weights to engines and asks the trainer for logprobs through callables, not imports)
  2.2 rollout (uses session)
  2.3 eval (uses rollout, and runs an in-process engine for agent evaluation); connectors (agent and
      environment libraries plugged into the rollout layers)
Packages at one position never import each other; only orchestration imports ray.
"""

import ast
import subprocess
import sys
from pathlib import Path

import verst

LAYERS = {
    "types": (0, 0), "config": (0, 1),  # the config's sampling section extends types' SamplingKnobs
    "algo": (1, 0), "data": (1, 0), "rewards": (1, 0), "monitor": (1, 0), "models": (1, 0),
    "sandbox": (1, 0),  # isolated places to run an agent's commands
    "inference_client": (2, 0),
    "engine": (2, 1), "engine_kinds": (2, 1), "router": (2, 1), "session": (2, 1), "trainer": (2, 1), "sync": (2, 1),
    "rollout": (2, 2),
    "eval": (2, 3), "connectors": (2, 3),
    "orchestration": (3, 0),
    "run": (4, 0),  # an RL run's parts over the orchestration's handles, and how it starts
    "schedules": (4, 1),  # the loops over a run's named steps
    "sim": (4, 2),  # an RL run on simulated engines and trainer: the schedules' loops over a simulated run
    "cli": (4, 3),  # the command line starts the schedules and the simulation
}
RAY_AWARE = {"orchestration"}


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_every_package_has_a_layer():
    root = Path(verst.__file__).parent
    packages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


def test_packages_import_only_lower_positions_and_ray_stays_in_orchestration():
    root = Path(verst.__file__).parent
    violations = []
    for package, position in LAYERS.items():
        for path in (root / package).rglob("*.py"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] == "ray" and package not in RAY_AWARE:
                    violations.append(f"{path.relative_to(root)} imports ray")
                if parts[0] != "verst" or len(parts) < 2 or parts[1] == package:
                    continue
                other = LAYERS.get(parts[1])
                if other is None or other >= position:
                    violations.append(f"{path.relative_to(root)} {position} imports {name} {other}")
    assert violations == []


def test_the_engine_client_imports_no_torch():
    # every caller of an engine imports it, the torch-free driver of an RL run included
    modules = ", ".join(f"verst.inference_client.{m}" for m in ("client", "batching", "protocol", "fleet", "ports"))
    code = f"import sys, verst.inference_client, {modules}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def module_graph() -> dict[str, set[str]]:
    """Every verst module (a package is its `__init__`) -> the verst modules of its own package it imports,
    wherever the import stands: at the top, inside a function or under TYPE_CHECKING."""
    root = Path(verst.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path

    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for target in filter(None, map(resolve, targets)):
                if target != name and target.split(".")[:2] == name.split(".")[:2]:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_package_has_an_import_circle_inside():
    """Counting every import, in functions and under TYPE_CHECKING too: a circle is not hidden, it is absent."""
    assert circles(module_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a.x.m": {"a.x.n"}, "a.x.n": {"a.x.m"}, "a.x.o": set()}) == [["a.x.m", "a.x.n"]]


MAX_MODULE_LINES = 450


def test_no_module_is_over_450_lines():
    root = Path(verst.__file__).parent
    long = {str(path.relative_to(root)): n for path in root.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
