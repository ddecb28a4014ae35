"""Structure checks over snugfit/'s source, read with `ast` (not imported): no import cycle, type-only and
function-local imports included; no method of torch's replaced on an instance."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "snugfit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(name: str, source: str, modules: set[str], is_package: bool = False) -> set[str]:
    """The `modules` that module `name` (of this `source`) imports anywhere (module level, under `if
    TYPE_CHECKING:`, inside functions). `from package import x` counts as importing the module package.x where
    that is one, else the package."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    sources = _sources()
    return {name: imported(name, path.read_text(), set(sources), path.name == "__init__.py")
            for name, path in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_names_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_are_seen_under_type_checking_in_functions_and_relative():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import A\n"
              "def f():\n    import p.b\nfrom . import c\nfrom .d import x\n")
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e"}
    assert imported("p.e", source, modules) == {"p.a", "p.b", "p.c", "p.d"}
    assert "snugfit.plan" in import_graph()["snugfit.runtime.build"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_runners_know_no_engine():
    """A step runner reads its step's StepContext (runtime.step_runner), never the engine that drives it."""
    graph = import_graph()
    runners = ("snugfit.runtime.step_runner", "snugfit.runtime.pipeline", "snugfit.runtime.bpipe")
    assert not [m for m in runners if "snugfit.runtime.engine" in graph[m]]


@functools.cache
def torch_methods() -> frozenset[str]:
    """The methods of the torch objects snugfit drives: a function assigned under one of these names on an instance
    changes what torch does at a distance (runtime.sharding once replaced FSDPModule.set_requires_gradient_sync on
    the root, so every runner's toggle silently did nothing). `forward` is left out: it is the model's own
    computation (snugfit's blocks), which torch calls through Module.__call__, not by name; the activation policies
    and compiled blocks wrap it there, at the block."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.tensor import DTensor

    classes = (torch.nn.Module, torch.Tensor, torch.optim.Optimizer, FSDPModule, PipelineStage,
               _PipelineScheduleRuntime, DTensor, DeviceMesh, dist.ProcessGroup)
    names = {n for cls in classes for n in dir(cls) if not n.startswith("__") and callable(getattr(cls, n, None))}
    return frozenset(names - {"forward"})


def _is_function(node: ast.expr, defined: set[str]) -> bool:
    """`node` evaluates to a function: a lambda, a def of this file (or a method of it, bound), functools.partial,
    functools.wraps or types.MethodType of one."""
    if isinstance(node, ast.Lambda) or (isinstance(node, ast.Name) and node.id in defined):
        return True
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        return name.endswith(("partial", "MethodType")) or name.startswith(("functools.wraps", "wraps"))
    return isinstance(node, ast.Attribute) and node.attr in defined


def replaced_methods(source: str, filename: str = "<source>") -> list[str]:
    """`obj.name = <function>` and `setattr(obj, name, <function>)` where name is a method of torch's (any name
    where setattr's is not a constant): "file:line code" of each."""
    tree = ast.parse(source, filename)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            hit = any(isinstance(t, ast.Attribute) and t.attr in torch_methods() for t in node.targets)
            hit = hit and _is_function(node.value, defined)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and len(node.args) == 3:
            name = node.args[1]
            named = not isinstance(name, ast.Constant) or name.value in torch_methods()
            hit = named and _is_function(node.args[2], defined)
        else:
            continue
        if hit:
            found.append(f"{filename}:{node.lineno} {ast.unparse(node)}")
    return found


def test_replaced_methods_are_found():
    assert replaced_methods("def f(flag, *, recurse=True): pass\nroot.set_requires_gradient_sync = f\n")
    assert replaced_methods("opt.step = lambda: None\n")
    assert replaced_methods("class Sync:\n    def on(self, flag): pass\nroot.set_requires_gradient_sync = sync.on\n")
    assert replaced_methods("import functools\nstage.backward_one_chunk = functools.partial(run, stage)\n")
    assert replaced_methods("def wrap(stage, name):\n    def timed(): pass\n    setattr(stage, name, timed)\n")
    assert not replaced_methods("plan.compile = True\nblock.forward = functools.partial(run, block.forward)\n")


def test_no_method_of_torch_replaced_on_an_instance():
    found = [hit for path in _sources().values() for hit in replaced_methods(path.read_text(), str(path))]
    assert not found, "methods of torch's replaced on an instance (subclass, or call torch's API):\n" + "\n".join(found)
