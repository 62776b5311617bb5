"""One base exception for the whole warehouse.

Every error names the bad input, the place, and what would be valid (dlt's habit), and says
whether retrying can help.
"""

from __future__ import annotations


class TrajwhError(Exception):
    """Base error: ``what`` was wrong, ``where`` it was, ``valid`` is what would be accepted."""

    retryable: bool = False

    def __init__(self, what: str, *, where: str | None = None, valid: str | None = None):
        self.what = what
        self.where = where
        self.valid = valid
        parts = [what]
        if where:
            parts.append(f"(at {where})")
        msg = " ".join(parts)
        if valid:
            msg += f". Valid: {valid}"
        if self.retryable:
            msg += ". Retrying may help."
        super().__init__(msg)


class ConfigError(TrajwhError):
    """A setting, path or argument the user gave is not usable."""


class InputFormatError(TrajwhError):
    """A record or file is not in a format the warehouse understands."""


class WarehouseBusyError(TrajwhError):
    """Another process holds the warehouse's write lock."""

    retryable = True


class CatalogError(TrajwhError):
    """The catalog is missing, damaged or of an incompatible version."""
