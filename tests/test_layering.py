"""The packages of batchrun form layers: what a module imports at run time (imports only for type
checking aside) never makes two packages import each other, directly or through others, and the
engine's stack (engine and everything it runs on) imports nothing of the job layer above it."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchrun"
ENGINE_STACK = {
    "engine", "speculative", "sampling", "models", "layers", "attention", "kernels",
    "parallel", "device", "errors",
}  # fmt: skip


def _unit(module: str) -> str:
    """batchrun.X.y -> X (a package, or a top-level module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _runtime_imports(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []  # for the type checker only
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchrun"):
            if node.module == "batchrun":
                yield from (f"batchrun.{alias.name}" for alias in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("batchrun."))


def package_imports() -> dict[str, dict[str, str]]:
    """unit -> {unit it imports: one file that does}."""
    edges: dict[str, dict[str, str]] = defaultdict(dict)
    for path in PACKAGE.rglob("*.py"):
        source = _unit(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for module in _runtime_imports(ast.parse(path.read_text())):
            target = _unit(module)
            if target != source:
                edges[source].setdefault(target, str(path.relative_to(PACKAGE.parent)))
    return edges


def test_no_two_packages_import_each_other() -> None:
    edges = package_imports()
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            loop = path[path.index(unit) :] + [unit]
            steps = [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(loop, loop[1:], strict=False)]
            raise AssertionError("import loop: " + "; ".join(steps))
        if unit in done:
            return
        for target in edges.get(unit, {}):
            visit(target, [*path, unit])
        done.add(unit)

    for unit in sorted(edges):
        visit(unit, [])


def test_the_engine_stack_imports_nothing_above_it() -> None:
    edges = package_imports()
    for unit in ENGINE_STACK:
        above = {t: f for t, f in edges.get(unit, {}).items() if t not in ENGINE_STACK}
        assert not above, f"{unit} imports {above}"


def test_the_cpu_path_imports_without_triton() -> None:
    """triton is an optional extra: the CLI, the engine and every attention backend's module
    import without it (the kernels load where a GPU path asks for them)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import batchrun.cli, batchrun.engine.engine, batchrun.preflight, batchrun.bench.shapes\n"
        "import batchrun.attention.torch_backend, batchrun.layers.fp8_linear\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
