"""The floors import downward only: a model file uses layers (and configs, utils), never an
engine, a stage or the orchestrator; layers use nothing above them; configs, utils, the outputs
and the params nothing above them either. Checked on the source, lazy imports inside functions
included."""

from __future__ import annotations

import ast
from pathlib import Path

import omnistage

PACKAGE = Path(omnistage.__file__).parent
RUNTIME = {"ar", "diffusion", "generation", "stages", "engine", "entrypoints", "benchmarks"}


def imported_floors(path: Path) -> set[tuple[str, int]]:
    """(top-level omnistage subpackage, line) of every import in `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "omnistage" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def test_models_and_layers_import_no_runtime() -> None:
    bad = []
    for floor in ("models", "layers"):
        for path in sorted((PACKAGE / floor).rglob("*.py")):
            bad += [f"{path.relative_to(PACKAGE)}:{line} imports omnistage.{sub}"
                    for sub, line in sorted(imported_floors(path)) if sub in RUNTIME]
    assert not bad, "\n".join(bad)


def test_the_bottom_imports_nothing_above_it() -> None:
    """configs (graph validation gets the adapter registry passed in), utils, the outputs, the
    params, the errors and the model-family registry (it names what it serves by "module:attr"
    strings, imported when a stage asks): no runtime, no models, no layers."""
    paths = [*sorted((PACKAGE / "configs").rglob("*.py")), *sorted((PACKAGE / "utils").rglob(
        "*.py")), PACKAGE / "outputs.py", PACKAGE / "sampling_params.py", PACKAGE / "errors.py",
        PACKAGE / "ranges.py", PACKAGE / "payloads.py",
        PACKAGE / "registry.py", PACKAGE / "family_records.py"]
    above = RUNTIME | {"models", "layers"}
    bad = [f"{path.relative_to(PACKAGE)}:{line} imports omnistage.{sub}"
           for path in paths for sub, line in sorted(imported_floors(path)) if sub in above]
    assert not bad, "\n".join(bad)


def test_the_check_sees_imports(tmp_path: Path) -> None:
    """The checker is not vacuous: it finds a top-level and a lazy import."""
    src = tmp_path / "m.py"
    src.write_text("from omnistage.ar.engine import AREngine\n"
                   "def f():\n    import omnistage.stages.worker\n")
    assert imported_floors(src) == {("ar", 1), ("stages", 3)}


def module_imports() -> dict[str, set[str]]:
    """Each omnistage module -> the omnistage modules it imports (lazy and TYPE_CHECKING
    imports included; `from pkg import name` counts as pkg.name when that is a module)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(head + ([base] if base else []))
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            for target in targets:
                found = resolve(target) if target.startswith("omnistage") else None
                # a package's own __init__ (the lazy `omnistage` front) is not an edge
                if found and found != module and modules[found].name != "__init__.py":
                    edges[module].add(found)
    return edges


def test_no_import_circles() -> None:
    """No module reaches itself through imports, lazy ones included: a circle means a piece
    lives on the wrong floor (move it down, or pass it in)."""
    edges = module_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
