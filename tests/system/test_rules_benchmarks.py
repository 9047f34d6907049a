"""One home for benchmark code (issue 39, docs/benchmarks.md says why): it lives in the package,
omnistage/benchmarks/; the repository's benchmarks/ holds only the GPU session scripts (shell)
and the results they wrote (benchmarks/results/)."""

from __future__ import annotations

from pathlib import Path

# the checkout: the first folder up with pyproject.toml (the tests may move into tiers)
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def stray_code(folder: Path) -> list[str]:
    """Python files anywhere in `folder`, and files at its top other than GPU session scripts
    (shell: device_session.sh, device_x4.sh, ...); results/ may hold anything a run wrote,
    code excepted."""
    if not folder.is_dir():
        return []
    found = [p.relative_to(folder).as_posix() for p in folder.rglob("*.py")]
    found += [p.name for p in folder.iterdir()
              if p.is_file() and p.suffix not in (".sh", ".py")]
    return sorted(found)


def test_benchmarks_folder_holds_no_code() -> None:
    bad = stray_code(REPO / "benchmarks")
    assert not bad, ("benchmark code belongs in omnistage/benchmarks/ (run it with "
                     "python -m omnistage.benchmarks.NAME):\n" + "\n".join(bad))


def test_the_check_sees_code(tmp_path: Path) -> None:
    """Not vacuous: Python at the top or under results/ and a stray file are found, a session
    script and a result are not."""
    (tmp_path / "results" / "runs").mkdir(parents=True)
    for name in ("device_session.sh", "results/ar.json", "results/runs/x.py", "bench.py",
                 "notes.txt"):
        (tmp_path / name).write_text("")
    assert stray_code(tmp_path) == ["bench.py", "notes.txt", "results/runs/x.py"]
    assert (REPO / "omnistage" / "benchmarks" / "ar_offline.py").is_file()
