"""The platform's error classes. The type decides what happens: retry, skip the record, or stop."""

from __future__ import annotations


class PlatformError(Exception):
    """Root of every error the platform raises on purpose."""


class RetriableError(PlatformError):
    """A transient failure (broker leader moved, Cassandra timeout): retry with backoff."""


class RetryLater(RetriableError):
    """Raised by a consumer's record handler: this record cannot be handled now (a store it needs is down). The
    consume loop rewinds to it and backs off; nothing is skipped."""

    def __init__(self, reason: str, delay_s: float) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class FatalError(PlatformError):
    """The process cannot continue (a dead engine, a commit that cannot succeed): exit non-zero."""


class DecodeError(PlatformError):
    """A record that does not decode with any released schema: skip it (dead-letter it), never crash."""
