"""User-facing exceptions of moetier; each message says what went wrong and what to do.

Imports nothing else from the package.
"""

from __future__ import annotations


class MoetierError(Exception):
    """Base class of every error a user can cause (bad input, bad files, bad settings)."""


class ConfigError(MoetierError, ValueError):
    """A setting or argument is invalid (budget strings, devices, dtypes, sampling params)."""


class CheckpointError(MoetierError):
    """A checkpoint directory or file cannot be used (missing shard, truncated file, ...)."""


class UnsupportedModelError(MoetierError):
    """The checkpoint's architecture has no registered model family."""


class BudgetError(ConfigError):
    """An expert or host budget is below what one step needs."""


class DeviceMemoryError(MoetierError):
    """The compute device has too little free memory for what the settings ask (expert slots,
    non-expert weights); the message says how much was asked, what was free, what to lower."""
