"""docs/configuration.md's reference section is generated from the config tree: the committed
page must equal what scripts/config_doc.py writes, so the two cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "config_doc.py"


def load_script():
    spec = importlib.util.spec_from_file_location("config_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_equals_the_generated_one() -> None:
    doc = load_script()
    text = doc.PAGE.read_text()
    assert doc.START in text and doc.END in text
    assert doc.updated(text) == text, "run: python scripts/config_doc.py"


def test_every_field_of_the_tree_has_a_row_with_help() -> None:
    doc = load_script()
    from omnistage.configs.engine_flags import fields_of

    section = doc.render()
    for row in fields_of():
        assert row.help, row.path
        assert f"| `stages[].{row.path}` |" in section
    assert "| `stages[].ar.max_num_seqs` | an integer | `64` | `--max-num-seqs` |" in section
