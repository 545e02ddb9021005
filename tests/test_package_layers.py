"""The package layering of docs/design.md, read from the source: a lower layer imports no higher one.

Checked statically (every import statement, also those inside functions), so a lazy import that
would only fire on some path cannot hide a cycle.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "gyre_jax"

# package -> gyre_jax packages it must not import (design.md's "must not" column, as imports)
FORBIDDEN = {
    "sharding.py": ("model", "cells", "serving", "rl", "agents", "pods", "scheduler", "trajectory", "losses"),
    "losses": ("model", "cells", "serving", "rl", "agents", "pods", "scheduler", "trajectory"),
    "model": ("cells", "serving", "rl", "agents", "pods", "scheduler"),
    "trajectory": ("cells", "rl", "pods"),
}


def imported_gyre_packages(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "gyre_jax" and len(parts) > 1:
                out.add(parts[1])
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layer_imports_no_higher_one(layer):
    target = ROOT / layer
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    assert files, f"{target} has no python files"
    bad = {str(f.relative_to(ROOT)): sorted(imported_gyre_packages(f) & set(FORBIDDEN[layer])) for f in files}
    bad = {f: pkgs for f, pkgs in bad.items() if pkgs}
    assert not bad, f"{layer} imports packages above it: {bad}"
