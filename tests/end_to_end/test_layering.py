"""The packages of batchrun form layers: what a module imports at run time (imports only for type
checking aside) never makes two packages import each other, directly or through others, and the
engine's stack (engine and everything it runs on) imports nothing of the job layer above it.
Within and across packages, no file imports itself through others: there every import counts,
those for type checking and those inside functions too (they are the design's real
dependencies)."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "batchrun"
ENGINE_STACK = {
    "engine",
    "spec_decode",
    "sampling",
    "models",
    "layers",
    "attention",
    "kernels",
    "parallel",
    "device",
    "errors",
}
HARNESS = {"bench", "train", "tools"}  # left out of the wheel: only the CLI dispatches to them


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


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_imports(tree: ast.Module, package: str) -> Iterator[str]:
    """Every batchrun module a file names in an import, wherever the import stands: for
    `from P import n`, P's submodule n where it is one, else P."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("batchrun"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            if base.startswith("batchrun"):
                yield base
                yield from (f"{base}.{a.name}" for a in node.names)


def file_imports() -> dict[str, dict[str, None]]:
    """module -> {batchrun module it imports}, every import counted."""
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, dict[str, None]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = _all_imports(ast.parse(path.read_text()), package)
        edges[module] = {t: None for t in targets if t in paths and t != module}
    return edges


def _loop(edges: Mapping[str, Mapping[str, object]]) -> list[str] | None:
    """One cycle of the graph (its nodes, the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(edges):
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(edges.get(start, {})))]
        on_path = [start]
        while stack:
            node, targets = stack[-1]
            target = next(targets, None)
            if target is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif target in on_path:
                return on_path[on_path.index(target) :] + [target]
            elif target not in done:
                stack.append((target, iter(edges.get(target, {}))))
                on_path.append(target)
    return None


def test_no_two_packages_import_each_other() -> None:
    edges = package_imports()
    loop = _loop(edges)
    if loop is not None:
        steps = [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(loop, loop[1:], strict=False)]
        raise AssertionError("import loop: " + "; ".join(steps))


def test_no_file_imports_itself_through_others() -> None:
    """Imports for type checking and inside functions count: a circle of files is one design
    decision spread over them, whichever way Python's import order is kept working."""
    edges = {module: dict(targets) for module, targets in file_imports().items()}
    loops = []
    while (loop := _loop(edges)) is not None:  # each found, then cut there, to name them all
        loops.append(" -> ".join(loop))
        del edges[loop[-2]][loop[-1]]
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_the_engine_stack_imports_nothing_above_it() -> None:
    edges = package_imports()
    for unit in ENGINE_STACK:
        above = {t: f for t, f in edges.get(unit, {}).items() if t not in ENGINE_STACK}
        assert not above, f"{unit} imports {above}"


def test_the_runtime_imports_no_harness_but_the_bench_command() -> None:
    found = {
        module: [t for t in targets if _unit(t) in HARNESS]
        for module, targets in file_imports().items()
        if _unit(module) not in HARNESS
    }
    assert {m for m, targets in found.items() if targets} <= {"batchrun.cli.bench"}, found


def test_the_cpu_path_imports_without_triton() -> None:
    """triton is an optional extra: the CLI, the engine and every attention backend's module
    import without it (the kernels load where a GPU path asks for them)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import batchrun.cli, batchrun.engine.engine, batchrun.config.preflight\n"
        "import batchrun.bench.shapes\n"
        "import batchrun.attention.torch_backend, batchrun.layers.fp8_linear\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
