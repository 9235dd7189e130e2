"""The Kafka client factory's choices (construction only), and its fixes to aiokafka while no broker answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import SimpleNamespace

import pytest
from aiokafka.consumer.fetcher import Fetcher

from runtime.kafka_clients import make_admin, make_consumer, make_producer, stop_consumer
from runtime.settings import KafkaSettings
from tests.helpers import wait_for


async def test_a_follower_polls_long_and_every_other_consumer_short() -> None:
    """A consumer that pauses, resumes or seeks waits out the poll parked at the broker before it fetches again
    (the worker's priority gate, the relay's rewinds), and so does any lookup on its connection (the tenancy view's
    end offsets): only a follower (the worker's cancels) may poll long."""
    kafka = KafkaSettings(fetch_max_wait_ms=100, follow_fetch_max_wait_ms=500)
    follower, other = make_consumer(kafka, role="r", follower=True), make_consumer(kafka, role="r")
    try:
        assert follower._fetch_max_wait_ms == 500
        assert other._fetch_max_wait_ms == 100
    finally:
        await follower.stop()
        await other.stop()



async def test_no_client_spins_on_metadata_updates_while_no_broker_answers(caplog: pytest.LogCaptureFixture) -> None:
    """restart-broker: while the broker was away every client retried its metadata update with no pause (aiokafka's
    sender and fetcher wait on the update and ask again at once): 400k failed connects per worker per outage. Here no
    broker is known, so each update fails at once, as a refused connect does; a caller asks again as the sender
    does. Within half a second a client backs off (100, 200 ms...) instead of failing thousands of times."""
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    producer, consumer, admin = make_producer(kafka, role="r"), make_consumer(kafka, role="r"), make_admin(kafka)
    clients = [producer.client, consumer._client, admin._client]
    caplog.set_level(logging.ERROR, logger="aiokafka.client")
    for client in clients:
        client._sync_task = asyncio.create_task(client._md_synchronizer())  # what bootstrap() starts
    try:
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            await asyncio.wait([asyncio.ensure_future(c.force_metadata_update()) for c in clients], timeout=0.6)
    finally:
        for client in clients:
            client._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await client._sync_task
        await consumer.stop()
    failed = sum("Unable to update metadata" in r.getMessage() for r in caplog.records)
    assert 0 < failed <= 3 * 4, f"{failed} failed metadata updates in 0.5 s from 3 clients"


def _awaiting(task: asyncio.Task[object]) -> list[str]:
    """The coroutines a task is suspended in, outermost first (empty: not started, running or done)."""
    names, coro = [], task.get_coro()
    while getattr(coro, "cr_await", None) is not None:
        names.append(coro.cr_code.co_name)  # type: ignore[union-attr]
        coro = coro.cr_await  # type: ignore[union-attr]
    return names


async def test_a_consumer_stops_whole_while_a_fetch_waits_out_its_back_off() -> None:
    """restart-broker: a worker stopping on a fatal error exited with a bare CancelledError out of aiokafka's
    ``consumer.stop()`` (its fetcher awaits a fetch it cancelled, and a fetch whose broker is away sleeps its retry
    back-off outside its own CancelledError handler), so the client was never closed. aiokafka's own Fetcher here,
    with one fetch to a broker nobody can reach."""
    consumer = make_consumer(KafkaSettings(bootstrap_servers="127.0.0.1:9"), role="r")
    client = consumer._client
    client._sync_task = asyncio.create_task(client._md_synchronizer())
    fetcher = consumer._fetcher = Fetcher(client, consumer._subscription, retry_backoff_ms=5_000)
    await wait_for(lambda: _awaiting(fetcher._fetch_task), timeout_s=5, interval_s=0.01,
                   what="the fetcher's routine waiting for an assignment")
    request = SimpleNamespace(topics=[])  # never sent: no connection to node 0
    fetch = asyncio.create_task(fetcher._proc_fetch_request(None, 0, request))
    fetcher._pending_tasks.add(fetch)
    await wait_for(lambda: "sleep" in _awaiting(fetch), timeout_s=5, interval_s=0.01,
                   what="the fetch failed (no such node) and sleeps its back-off")
    await stop_consumer(consumer)
    assert client._sync_task is None, "the client was not closed"
    assert all(task.done() for task in fetcher._pending_tasks)


async def test_stopping_a_consumer_can_still_be_cancelled() -> None:
    consumer = make_consumer(KafkaSettings(bootstrap_servers="127.0.0.1:9"), role="r")
    stopped = asyncio.Event()

    async def slow_stop() -> None:
        await stopped.wait()

    consumer.stop = slow_stop  # type: ignore[method-assign]
    stopping = asyncio.create_task(stop_consumer(consumer))
    await asyncio.sleep(0)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
