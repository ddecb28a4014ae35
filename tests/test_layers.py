"""The package's layering, read from its import statements: no import cycle between modules, nothing below the
runtime imports it (or what sits on it), and the planner stays pure (no torch.distributed, no devices)."""

from __future__ import annotations

import ast
from pathlib import Path

import snugfit

ROOT = Path(snugfit.__file__).parent
BELOW_RUNTIME = ("errors", "config", "data", "model", "profile", "hardware", "plan", "report")
RUNTIME_AND_ABOVE = ("runtime", "calibrate", "train", "commands", "cli")


def _imports(tree: ast.AST) -> set[str]:
    """Modules imported anywhere in `tree` (function bodies too), except under `if TYPE_CHECKING:`."""
    out: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        out |= _imports(node)
    return out


def _graph() -> dict[str, set[str]]:
    modules = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = _imports(ast.parse(f.read_text()))
    return {m: {d for d in deps if d in modules and d != m} | {d for d in deps if d.startswith("torch")}
            for m, deps in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among snugfit's modules, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if d.startswith("snugfit") and state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d.startswith("snugfit") and d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_no_import_cycle():
    assert _cycle(_graph()) is None


def test_cycles_are_found():
    assert _cycle({"snugfit.a": {"snugfit.b"}, "snugfit.b": {"snugfit.c"}, "snugfit.c": {"snugfit.a"}}) == [
        "snugfit.a", "snugfit.b", "snugfit.c", "snugfit.a"]


def test_nothing_below_the_runtime_imports_it():
    wrong = [(m, d) for m, deps in _graph().items() if _layer(m) in BELOW_RUNTIME
             for d in deps if _layer(d) in RUNTIME_AND_ABOVE]
    assert wrong == []


def test_the_planner_is_pure():
    wrong = [(m, d) for m, deps in _graph().items() if _layer(m) == "plan"
             for d in deps if d.startswith(("torch.distributed", "torch.cuda", "torch.accelerator"))]
    assert wrong == []
