"""The connector tests' payload fixtures (tests/helpers/connectors.py)."""

from tests.helpers.connectors import assert_same, payload  # noqa: F401 (fixtures)
