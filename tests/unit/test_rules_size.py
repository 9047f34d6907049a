"""Size rules (issue 39): no file in the package over 450 lines, no function over 60 lines
except Triton kernels (`@triton.jit`, whose one launch is one body by design). A file that
grows past the limit is split by noun (STYLE.md), not cut at line 449. Checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import omnistage

PACKAGE = Path(omnistage.__file__).parent
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60

# Exceptions, each with its reason (none now); test_allowlist_is_current fails on a stale one.
# Keys: a file's path under omnistage/ (too long), or "path:function" (a function too long).
ALLOWED: dict[str, str] = {
}


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated `@triton.jit`, `@triton.jit(...)` or `@jit` (from triton)."""
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = ast.unparse(target)
        if name in ("triton.jit", "jit"):
            return True
    return False


def oversized(path: Path, root: Path) -> list[str]:
    """The size rules' breaches in one file: "rel" for a file over MAX_FILE_LINES lines,
    "rel:name" for each function (nested ones too) over MAX_FUNCTION_LINES lines, counted
    from its `def` line to its last line."""
    rel = path.relative_to(root).as_posix()
    source = path.read_text()
    found = [rel] if len(source.splitlines()) > MAX_FILE_LINES else []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and not _is_triton_kernel(node) \
                and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
            found.append(f"{rel}:{node.name}")
    return found


def breaches() -> list[str]:
    return [b for path in sorted(PACKAGE.rglob("*.py")) for b in oversized(path, PACKAGE)]


def test_no_file_or_function_too_long() -> None:
    bad = [b for b in breaches() if b not in ALLOWED]
    assert not bad, (f"over {MAX_FILE_LINES} lines (file) or {MAX_FUNCTION_LINES} (function); "
                     "split by noun:\n" + "\n".join(bad))


def test_allowlist_is_current() -> None:
    """Every allowlisted breach still exists: a landed split takes its entry out."""
    found = set(breaches())
    stale = [f"{key} ({owner})" for key, owner in ALLOWED.items() if key not in found]
    assert not stale, "no longer too long; remove from ALLOWED:\n" + "\n".join(stale)


def test_the_check_sees_breaches(tmp_path: Path) -> None:
    """Not vacuous: it finds a long file and a long function (nested too), spares a Triton
    kernel and a function at the limit, and the package scan reads real files."""
    body, nested = "    x = 1\n", "        x = 1\n"
    src = tmp_path / "m.py"
    src.write_text(
        "import triton\n\n"
        f"def at_limit():\n{body * (MAX_FUNCTION_LINES - 1)}\n"
        f"def too_long():\n{body * MAX_FUNCTION_LINES}\n"
        f"def outer():\n    def inner():\n{nested * MAX_FUNCTION_LINES}\n"
        f"@triton.jit\ndef kernel():\n{body * 100}\n"
        f"@triton.jit(do_not_specialize=['n'])\ndef kernel2():\n{body * 100}\n"
        + "# pad\n" * MAX_FILE_LINES)
    assert oversized(src, tmp_path) == ["m.py", "m.py:too_long", "m.py:outer", "m.py:inner"]
    short = tmp_path / "short.py"
    short.write_text("def f():\n    return 1\n")
    assert oversized(short, tmp_path) == []
    assert len(list(PACKAGE.rglob("*.py"))) > 100
