"""Errors of the testing helpers (a test set up wrongly, not a pipeline failing)."""

from __future__ import annotations

from onceflow.kernel.errors import OnceflowError


class TestingError(OnceflowError):
    """A test helper was used wrongly; the message says how to fix the test."""

    __test__ = False  # not a pytest test class


class TestInputError(TestingError):
    """The inputs of a test run are missing or malformed."""

    __test__ = False
