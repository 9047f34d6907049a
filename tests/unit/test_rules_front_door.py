"""Issue 39 item 2, one front door: a request's per-stage params are built in one place
(engine/request.py: `build_request`, the only caller of `stage_params`), and engine/ imports
no stage-kind package (diffusion/, ar/, generation/), lazy imports included. Checked on the
source, with a check that each checker is not vacuous."""

from __future__ import annotations

import ast
from pathlib import Path

import omnistage

PACKAGE = Path(omnistage.__file__).parent
FRONT_DOOR = PACKAGE / "engine" / "request.py"
STAGE_KINDS = {"diffusion", "ar", "generation"}
# exceptions (file, subpackage): none, and none should come back
PENDING: set[tuple[str, str]] = set()


def stage_params_calls(path: Path) -> list[int]:
    """Lines of every call of a function named `stage_params` or `_stage_params`."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else None
            if name is not None and name.lstrip("_") == "stage_params":
                lines.append(node.lineno)
    return lines


def kind_imports(path: Path, root: Path = PACKAGE.parent) -> list[tuple[str, int]]:
    """(omnistage subpackage, line) of every import of a stage-kind package in `path`,
    anywhere in the file (a function's lazy import too), relative imports resolved."""
    found = []
    parts = path.relative_to(root).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[:len(parts) - node.level]
                names = [".".join([*base, *(node.module.split(".") if node.module else [])])]
            elif node.module:
                names = [node.module]
            if node.module == "omnistage" or (node.level and not node.module):
                names += [f"omnistage.{a.name}" for a in node.names]
        for name in names:
            bits = name.split(".")
            if bits[0] == "omnistage" and len(bits) > 1 and bits[1] in STAGE_KINDS:
                found.append((bits[1], node.lineno))
    return found


def test_no_stage_params_call_outside_the_front_door() -> None:
    bad = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
           if path != FRONT_DOOR for line in stage_params_calls(path)]
    assert not bad, "stage_params( called outside engine/request.py:\n" + "\n".join(bad)
    assert stage_params_calls(FRONT_DOOR), "the front door builds no params (moved?)"


def test_engine_imports_no_stage_kind() -> None:
    bad = [f"{path.relative_to(PACKAGE)}:{line} imports omnistage.{sub}"
           for path in sorted((PACKAGE / "engine").rglob("*.py"))
           for sub, line in kind_imports(path)
           if (str(path.relative_to(PACKAGE)), sub) not in PENDING]
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """Not vacuous: a call by name and by attribute, a top-level, lazy and relative import."""
    src = tmp_path / "omnistage" / "engine" / "probe.py"
    src.parent.mkdir(parents=True)
    calls = tmp_path / "calls.py"
    calls.write_text("stage_params(g, e, f)\nself._stage_params(x)\nstage_params_x(1)\n")
    assert stage_params_calls(calls) == [1, 2]
    src.write_text("from omnistage.ar.engine import AREngine\n"
                   "def f():\n    import omnistage.diffusion.params\n"
                   "from ..generation import engine\n"
                   "from omnistage import ar\n"
                   "from omnistage.stages import worker\n")
    assert sorted(kind_imports(src, tmp_path)) == [("ar", 1), ("ar", 5), ("diffusion", 3),
                                                   ("generation", 4)]
