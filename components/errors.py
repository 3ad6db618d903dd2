"""The errors a person acts on, in a module light enough for the CLI to import: a malformed setting (shared by the
pipeline config and the feature spec), and data that failed validation."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown or malformed."""


class DataValidationError(RuntimeError):
    """A raw slice failed validation. The message names the failed expectations and the report's path."""
