"""DESIGN.md's layer rule as a test: a package imports only from its own layer or those below."""

import ast
from pathlib import Path

import verst

LAYERS = {
    "types": 0, "config": 0,
    "algo": 1, "data": 1, "rewards": 1, "monitor": 1, "models": 1,
    "inference_client": 2, "engine": 2, "router": 2, "session": 2, "rollout": 2, "trainer": 2, "sync": 2, "eval": 2,
    "orchestration": 3,
    "schedules": 4, "cli": 4,
}
# Same-layer imports are allowed only where DESIGN.md names the dependency.
RAY_AWARE = {"orchestration", "schedules"}


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


def test_layers_import_only_downward_and_ray_stays_in_orchestration():
    root = Path(verst.__file__).parent
    violations = []
    for package, layer in LAYERS.items():
        for path in (root / package).rglob("*.py"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] == "ray" and package not in RAY_AWARE:
                    violations.append(f"{path.relative_to(root)} imports ray")
                if parts[0] != "verst" or len(parts) < 2 or parts[1] == package:
                    continue
                other = LAYERS.get(parts[1])
                if other is None or other > layer:
                    violations.append(f"{path.relative_to(root)} (layer {layer}) imports {name} (layer {other})")
    assert violations == []
