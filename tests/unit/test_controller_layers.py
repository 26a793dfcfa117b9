"""The Controller's parts never import it back: no import circle through controller.py."""

from __future__ import annotations

import ast
from pathlib import Path

import tpkv

ROOT = Path(tpkv.__file__).parent.parent
CONTROLLER = "tpkv.controller.controller"


def _imports(module: str) -> set[str]:
    """Every tpkv module `module` imports anywhere in its file (TYPE_CHECKING blocks and
    function bodies too): `from a import b` counts as a.b when that is a module, else a."""
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tpkv")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tpkv"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                as_module = ROOT / (sub.replace(".", "/") + ".py")
                out.add(sub if as_module.exists() else node.module)
    return out


def _reach(start: set[str]) -> dict[str, str]:
    """Modules reachable from `start` through tpkv imports -> the module that imports each."""
    seen = {m: "" for m in start}
    todo = list(start)
    while todo:
        m = todo.pop()
        for n in _imports(m):
            if n not in seen:
                seen[n] = m
                todo.append(n)
    return seen


def test_controller_parts_do_not_import_the_controller() -> None:
    parts = _imports(CONTROLLER) - {CONTROLLER}
    assert "tpkv.controller.step" in parts  # (the parser sees the controller's imports)
    reached = _reach(parts)
    assert CONTROLLER not in reached, (
        f"{reached.get(CONTROLLER)} imports {CONTROLLER}, which imports it back (a circle)")


def test_step_does_not_import_the_controller() -> None:
    assert CONTROLLER not in _imports("tpkv.controller.step")
    assert CONTROLLER not in _imports("tpkv.controller.steptypes")
