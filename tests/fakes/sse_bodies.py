"""A body iterator for the SSE response's tests: its events, then a wait that only a cancellation ends; it records
how it ended (``end``, ``cancelled``, or ``closed`` by aclose)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


class Body:
    def __init__(self, events: list[bytes], *, then_wait: bool = True) -> None:
        self.events, self.then_wait = events, then_wait
        self.waiting = asyncio.Event()
        self.ended_by: str | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            for event in self.events:
                await asyncio.sleep(0)  # waits for each event (the listener runs meanwhile)
                yield event
            if self.then_wait:
                self.waiting.set()
                await asyncio.Event().wait()
            self.ended_by = "end"
        except asyncio.CancelledError:
            self.ended_by = "cancelled"
            raise
        finally:
            self.ended_by = self.ended_by or "closed"


def tasks_now() -> set[asyncio.Task[Any]]:
    """The tasks other than the caller's: what a response left running."""
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
