"""A fresh request's generation started while its claim is still on its way to Redis.

The claim (``claims.py``) decides whether this worker may generate a request; it is a Redis round trip, and the
engine's prefill is far longer. A request that nothing says is taken over (no earlier attempt in the partition's
commit metadata, no cancel waiting for it) goes to the engine at once, and its claim runs beside the prefill:
the claim's round trip leaves the time to first token. Nothing is emitted before the claim's verdict: the request's
task is only created, and only reads the engine's output, once the claim says START with no earlier attempt. Any
other verdict, or a claim that fails, drops the head start: the engine aborts the request, nothing was emitted,
and what follows is what would have followed without it (a takeover reads the log and starts its own generation).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from inference_workers.protocol import EngineDelta


class HeadStart:
    """The engine's output of a request added ahead of its claim: read once through :meth:`deltas`, or dropped."""

    def __init__(self, deltas: AsyncGenerator[EngineDelta, None]) -> None:
        self._deltas = deltas
        # Iterating the generator once is what hands the request to the engine; the output waits in this task.
        self._first: asyncio.Future[EngineDelta] = asyncio.ensure_future(deltas.__anext__())
        self._dropping: asyncio.Future[None] | None = None

    @property
    def dropped(self) -> bool:
        return self._dropping is not None

    async def deltas(self) -> AsyncGenerator[EngineDelta, None]:
        """The engine's output from its first delta; closing it aborts the request in the engine."""
        try:
            try:
                first = await self._first
            except StopAsyncIteration:
                return
            yield first
            async for delta in self._deltas:
                yield delta
        finally:
            await self.drop()

    async def drop(self) -> None:
        """Abort the request in the engine, whatever it got to (idempotent; its output and errors are discarded).
        The abort runs once, to its end, in a task of its own: a caller cancelled while it waits (an abort, then a
        revocation) does not cut it short."""
        if self._dropping is None:
            self._dropping = asyncio.ensure_future(self._abort())
        await asyncio.shield(self._dropping)

    async def _abort(self) -> None:
        try:
            if not self._first.done():
                self._first.cancel()  # the engine's generator aborts the request on the cancel
                await asyncio.wait({self._first})
            if not self._first.cancelled():
                self._first.exception()  # retrieved: its errors are of no interest once dropped
        finally:
            await self._deltas.aclose()
