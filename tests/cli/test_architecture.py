"""The house in layers: imports point one way, no circles, short files and functions.

Layers, bottom to top (a module may import its own package, and packages of a lower rank):

    0  files                        files written whole (the leaf under every writer)
    1  garden, report               the corpus; printing
    2  runtime                      devices, meshes, processes, the launcher
    3  model, costmodel, data       the one model; closed forms; the data pipeline
    4  parallel                     plans, layouts, the sharded step
    5  training, measure            the loop and its hooks; HLO and timing
    6  compare, bench               the main job; one step timed
    7  cli                          the `jaxscale` command

Every import is read, at module level and inside functions. An import inside a function
is allowed only in cli/ (where it keeps `jaxscale --help` from importing JAX), never to hide
a circle: the module graph, with function-level imports included, must be acyclic.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "jaxscale"
RANK = {"files": 0,
        "garden": 1, "report": 1,
        "runtime": 2,
        "model": 3, "costmodel": 3, "data": 3,
        "parallel": 4,
        "training": 5, "measure": 5,
        "compare": 6, "bench": 6,
        "cli": 7}
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 80
MAX_FLAT_MODULES = 8


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The jaxscale module an imported name lives in (a submodule, or its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported jaxscale module, inside a function?) for every import in the file."""
    tree = ast.parse(path.read_text())
    inside = {id(n) for f in ast.walk(tree)
              if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] == "jaxscale" and (m := _resolve(n)) and m != "jaxscale":
                out.append((m, id(node) in inside))
    return out


def _layer(module: str) -> str:
    return module.split(".")[1].removesuffix("") if module != "jaxscale" else ""


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    missing = sorted({_layer(m) for m in MODULES if m != "jaxscale"} - set(RANK) - {"__main__"})
    assert not missing, f"packages without a rank in RANK: {missing}"


def test_imports_point_down():
    upward = [f"{m} -> {t}" for m, deps in GRAPH.items() if m not in ("jaxscale", "jaxscale.__main__")
              for t, _ in deps
              if _layer(t) != _layer(m) and RANK[_layer(t)] >= RANK[_layer(m)]]
    assert not upward, "imports that point up or sideways:\n" + "\n".join(sorted(set(upward)))


def test_imports_inside_functions_only_in_the_cli():
    hidden = sorted({f"{m} -> {t}" for m, deps in GRAPH.items() for t, inside in deps
                     if inside and _layer(m) != "cli"})
    assert not hidden, "imports inside functions outside cli/:\n" + "\n".join(hidden)


def test_no_import_circle():
    graph = {m: {t for t, _ in deps if t != m} for m, deps in GRAPH.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # a package's __init__ importing its own submodules is the package, not a circle
    cycles = [c for c in cycles if not all(x.startswith(c.split(" -> ")[0] + ".")
                                            for x in c.split(" -> ")[1:-1])]
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_files_are_short():
    long = {str(p.relative_to(PACKAGE)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_functions_are_short():
    long = {}
    for p in MODULES.values():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_few_modules_at_the_top():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= MAX_FLAT_MODULES, flat


@pytest.mark.parametrize("bad", ["jaxscale.parallel.plan -> jaxscale.cli.main"])
def test_the_checker_sees_an_upward_import(bad):
    src, dst = bad.split(" -> ")
    assert RANK[_layer(dst)] >= RANK[_layer(src)]
