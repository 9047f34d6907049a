"""Helpers shared by test files of several folders (and, after the move to tiers, of several
tiers); fixtures stay in tests/conftest.py. Imported as `tests.helpers.<module>` (pyproject's
pytest `pythonpath` puts the repository root on sys.path)."""
