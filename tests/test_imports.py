"""The package's import graph has no cycles, counting imports inside functions too (a lazy
import that closes a cycle only hides it), and the core reads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "pagedllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        # The bare package is every module's parent: importing it is no edge of a cycle.
        graph[name] = {d for d in deps if d in modules and d not in ("pagedllm", name)}
    return graph


def find_cycle(graph: dict[str, set[str]]):
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep, stack + [dep])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_core_and_config_import_no_torch():
    code = (
        "import sys, pagedllm.config, pagedllm.core.scheduler, pagedllm.engine.processor; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True)
    assert out.stdout.strip() == "False"


def test_core_imports_neither_torch_nor_models():
    """Every module of pagedllm.core imports without torch or pagedllm.models: the KV cache
    layout reaches the scheduler from the worker, which built the layers."""
    import pkgutil

    import pagedllm.core

    modules = [f"pagedllm.core.{m.name}" for m in pkgutil.iter_modules(pagedllm.core.__path__)]
    assert "pagedllm.core.scheduler" in modules and "pagedllm.core.kv_cache_utils" in modules
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(k for k in ('torch', 'pagedllm.models') if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def pagedllm_imports(source: str) -> list[str]:
    """Every pagedllm module a source imports, at module level or inside a function or class
    (relative imports named by their dots)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names if a.name.split(".")[0] == "pagedllm"]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.level or module.split(".")[0] == "pagedllm":
                names.append(module)
    return names


def subsystem_imports(source: str) -> list[str]:
    """The imports of a source that reach a subsystem: a subpackage of pagedllm (models, core,
    attention, ...) rather than one of its leaf modules (json_config.py, envs.py, ...)."""
    leaves = {p.stem for p in PKG.glob("*.py")}
    return [
        m for m in pagedllm_imports(source) if m.startswith(".") or (m != "pagedllm" and m.split(".")[1] not in leaves)
    ]


def test_the_subsystem_finder_sees_an_import_inside_a_function():
    source = (
        "import json\nfrom pagedllm.json_config import fields_from_json\n"
        "class C:\n    def f(self):\n        from pagedllm.models.registry import resolve_architecture\n"
        "def g():\n    import pagedllm.attention.backends.registry\n    from . import envs\n"
    )
    assert sorted(pagedllm_imports(source)) == [
        ".",
        "pagedllm.attention.backends.registry",
        "pagedllm.json_config",
        "pagedllm.models.registry",
    ]
    # A relative import counts as a subsystem's: config.py names what it imports in full.
    assert sorted(subsystem_imports(source)) == [
        ".",
        "pagedllm.attention.backends.registry",
        "pagedllm.models.registry",
    ]


def test_config_imports_no_subsystem():
    """config.py is read by every layer: anywhere in it (inside functions too) it imports only the
    standard library and the package's leaf helpers, never a subsystem; reading a model directory
    into a ModelConfig is models/model_config_loader.py's."""
    source = (PKG / "config.py").read_text()
    assert "pagedllm.json_config" in pagedllm_imports(source)
    assert subsystem_imports(source) == []
