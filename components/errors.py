"""The error a malformed setting raises, shared by the pipeline config and the feature spec."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown or malformed."""
