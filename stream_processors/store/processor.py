"""The store processor: stored completions (``store: true``) from the log into Cassandra.

Guarantee: Faust ``exactly_once``, for its ``read_committed`` consumer: a completion from an aborted worker
transaction (a worker fenced before its commit) is never stored. The sink does not rely on it: the write is
first-wins by completion id (``completions.py``), so a redelivery writes nothing twice and cannot bring back a
deleted completion. The gateway never writes these rows: a client whose gateway died still finds its completion.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import faust

from runtime.cassandra_client import connect
from runtime.metrics import STORED_COMPLETIONS
from runtime.retry import retry_transient
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import StoredCompletion
from schemas.topics import TOPICS
from stream_processors.app import DeadLetters, build_app, raw_topic
from stream_processors.store.completions import CompletionStore

log = logging.getLogger(__name__)


def build(settings: Settings) -> faust.App:
    app = build_app(settings, "store", guarantee="exactly_once")
    _cluster, session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    store = CompletionStore(session, settings.cassandra.keyspace)
    dead = DeadLetters(app, settings, "store")
    codec = codec_for(StoredCompletion)

    @app.agent(raw_topic(app, settings, TOPICS.stored_completions))
    async def write(stream: Any) -> None:
        async for event in stream.events():
            stored = await dead.decode(codec, event)
            if stored is None:
                continue
            created = await retry_transient(partial(store.write, stored), what="stored completion write")
            STORED_COMPLETIONS.labels(created=str(created).lower()).inc()
            log.info("completion stored", extra={"request_id": stored.completion_id, "new_row": created})

    return app
