"""Fixtures shared with the integration tests: the small tiny_lm, warm and trained."""

from tests.integration.conftest import project, trained, trained_once, warm_project  # noqa: F401
