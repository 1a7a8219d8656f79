"""Kept for imports in tests: the stack lives in kvops.localstack."""
from kvops.localstack import Stack, free_port  # noqa: F401
