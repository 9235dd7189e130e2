"""The Cassandra session factory and an awaitable ``execute``.

cassandra-driver is callback-based: :func:`execute` turns ``execute_async``'s ResponseFuture into an asyncio
future, so services never block their event loop on a query; :func:`pages` yields a large result a page at a time.
Connecting is blocking and runs in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from cassandra import ConsistencyLevel
from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile, ResponseFuture, Session
from cassandra.policies import DCAwareRoundRobinPolicy
from cassandra.query import PreparedStatement, SimpleStatement, Statement, dict_factory

from runtime.settings import CassandraSettings


def connect(settings: CassandraSettings, *, keyspace: str | None = None) -> tuple[Cluster, Session]:
    """Blocking connect; call it through ``asyncio.to_thread`` from async code."""
    profile = ExecutionProfile(
        load_balancing_policy=DCAwareRoundRobinPolicy(),
        request_timeout=settings.request_timeout_s,
        row_factory=dict_factory,
    )
    cluster = Cluster(
        contact_points=settings.hosts,
        port=settings.port,
        protocol_version=5,
        connect_timeout=settings.connect_timeout_s,
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
    )
    return cluster, cluster.connect(keyspace)


async def connect_async(settings: CassandraSettings) -> tuple[Cluster, Session]:
    return await asyncio.to_thread(connect, settings, keyspace=settings.keyspace)


def prepare(session: Session, query: str) -> PreparedStatement:
    """Blocking: a prepared statement at LOCAL_QUORUM, the consistency level of every store of the platform (a
    quorum of the local data center's replicas: a read sees every write acknowledged before it)."""
    statement = session.prepare(query)
    statement.consistency_level = ConsistencyLevel.LOCAL_QUORUM
    return statement


async def execute(
    session: Session, statement: str | PreparedStatement, params: Sequence[Any] | None = None
) -> list[dict[str, Any]]:
    """Run one statement; all pages of its result are fetched (callbacks run on the driver's thread)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[list[dict[str, Any]]] = loop.create_future()
    future: ResponseFuture = session.execute_async(statement, params)
    collected: list[dict[str, Any]] = []

    def on_ok(rows: Any) -> None:
        collected.extend(rows or [])
        if future.has_more_pages:
            future.start_fetching_next_page()
            return
        loop.call_soon_threadsafe(_settle, done, collected, None)

    def on_err(exc: BaseException) -> None:
        loop.call_soon_threadsafe(_settle, done, None, exc)

    future.add_callbacks(on_ok, on_err)
    return await done


async def pages(session: Session, statement: str | PreparedStatement, params: Sequence[Any] | None = None, *,
                page_size: int = 1000) -> AsyncIterator[list[dict[str, Any]]]:
    """Run one statement and yield its result a page at a time: the next page is asked for only once the caller
    takes this one, so a large result is never held whole (``execute`` holds every page). Leaving the loop early
    fetches nothing more."""
    loop = asyncio.get_running_loop()
    query: Statement = (statement.bind(params or ()) if isinstance(statement, PreparedStatement)
                        else SimpleStatement(statement))
    query.fetch_size = page_size
    #: the page being waited for (the driver calls back once per page, on its own thread)
    waiting: list[asyncio.Future[list[dict[str, Any]]]] = [loop.create_future()]

    def on_ok(rows: Any) -> None:
        loop.call_soon_threadsafe(_settle, waiting[0], list(rows or []), None)

    def on_err(exc: BaseException) -> None:
        loop.call_soon_threadsafe(_settle, waiting[0], None, exc)

    future: ResponseFuture = session.execute_async(query, None if isinstance(statement, PreparedStatement) else params)
    future.add_callbacks(on_ok, on_err)
    while True:
        page = await waiting[0]
        more = future.has_more_pages
        yield page
        if not more:
            return
        waiting[0] = loop.create_future()  # before the fetch: its callback settles this one
        future.start_fetching_next_page()


def _settle(done: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if done.done():
        return
    if exc is not None:
        done.set_exception(exc)
    else:
        done.set_result(result)
