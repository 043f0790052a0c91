"""The package's shape, as docs/design.md ("Layering") states it, checked on the source: no import circle
among allscan's modules (imports inside functions included), no private name imported from another
module (nor by the benchmarks and examples), no function taking more than ten positional parameters
(Triton kernels aside: a launch passes every pointer and stride), no module much over 400 lines."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "python"
MAX_POSITIONAL = 10
MAX_LINES = 420


def _modules():
    """``{dotted name: (path, syntax tree)}`` of every module of the package."""
    mods = {}
    for path in sorted((ROOT / "allscan").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = (path, ast.parse(path.read_text()))
    return mods


MODULES = _modules()


def _imports(name, path, tree):
    """``[(module imported from, name imported or None)]`` of one module, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "allscan"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] == "allscan":
                found += [(source, a.name) for a in node.names]
    return found


def _dependencies():
    """The module graph: an import of a submodule counts as a dependency on that submodule only."""
    graph = {}
    for name, (path, tree) in MODULES.items():
        deps = set()
        for source, imported in _imports(name, path, tree):
            target = f"{source}.{imported}" if f"{source}.{imported}" in MODULES else source
            if imported != "_C" and target in MODULES and target != name:  # _C: the compiled extension
                deps.add(target)
        graph[name] = deps
    return graph


def _circle(graph):
    """One import circle of the graph (a list of modules), or None."""
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return trail[trail.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, trail + [dep])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_checks_see_the_package():
    assert {"allscan", "allscan.context", "allscan.ops.delta.fla", "allscan.layers"} <= set(MODULES)
    graph = _dependencies()
    assert "allscan.ops.delta.fla_imports" in graph["allscan.ops.delta.fla"]
    # and the circle finder finds a circle where there is one
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle():
    circle = _circle(_dependencies())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_no_private_name_imported_from_another_module():
    reach_ins = [f"{name} imports {imported} from {source}"
                 for name, (path, tree) in MODULES.items() for source, imported in _imports(name, path, tree)
                 if imported and imported.startswith("_") and not imported.startswith("__") and imported != "_C"
                 and f"{source}.{imported}" not in MODULES]
    assert not reach_ins, reach_ins


def test_benchmarks_and_examples_use_public_names_only():
    """bench/ and examples/ reach allscan through its public modules and names (the documented hooks included),
    never a private module or name: what they time and show is what a user can call."""
    reach_ins = []
    for path in sorted([*(ROOT.parent / "bench").glob("*.py"), *(ROOT.parent / "examples").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "allscan":
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "allscan"]
            else:
                continue
            reach_ins += [f"{path.name}: {n}" for n in names if any(part.startswith("_") for part in n.split("."))]
    assert not reach_ins, reach_ins


def _is_kernel(fn) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_no_function_takes_more_than_ten_positional_parameters():
    limit = MAX_POSITIONAL
    long_lists = [f"{name}.{fn.name}: {len(fn.args.posonlyargs) + len(fn.args.args)}"
                  for name, (_, tree) in MODULES.items() for fn in ast.walk(tree)
                  if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(fn)
                  and len(fn.args.posonlyargs) + len(fn.args.args) > limit]
    assert not long_lists, f"more than {limit} positional parameters (use a named record): {long_lists}"


def test_no_module_much_over_400_lines():
    lines = {name: len(path.read_text().splitlines()) for name, (path, _) in MODULES.items()}
    long_files = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert not long_files, f"split these by concern: {long_files}"
