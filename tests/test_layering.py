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
        PACKAGE / "ranges.py",
        PACKAGE / "registry.py"]
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
