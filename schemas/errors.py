"""The platform's error classes. The type decides what happens: retry, skip the record, or stop."""

from __future__ import annotations


class PlatformError(Exception):
    """Root of every error the platform raises on purpose."""


class RetriableError(PlatformError):
    """A transient failure (broker leader moved, Cassandra timeout): retry with backoff."""


class FatalError(PlatformError):
    """The process cannot continue (a lost reply-partition lease, a dead engine): exit non-zero."""


class DecodeError(PlatformError):
    """A record that does not decode with any released schema: skip it (dead-letter it), never crash."""
