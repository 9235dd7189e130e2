from collections.abc import AsyncIterator

import pytest_asyncio

from tests.fakes.worker import stop_made_workers


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def _stop_made_workers() -> AsyncIterator[None]:
    yield
    await stop_made_workers()
