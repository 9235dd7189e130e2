"""The store processor: stored completions (``store: true``) and conversation turns from the log into Cassandra.

It is the conversation writer: a recorded turn's input items and answer are appended to its conversation, and a
Responses API turn with ``store: true`` becomes its stored response (``turns.py`` maps a record to its rows).

Guarantee: Faust ``exactly_once``, for its ``read_committed`` consumer: a completion from an aborted worker
transaction (a worker fenced before its commit) is never stored. The sink does not rely on it: the write is
first-wins by completion id (``completions.py``), so a redelivery writes nothing twice and cannot bring back a
deleted completion; items are upserts keyed by ids derived from the request id, so a redelivered turn rewrites the
same items, and a response row is first-wins. The answer item is written after the input items: a next turn that
waits for its predecessor's answer (``producers/gateway/turns.py``) then finds the whole turn. The gateway never
writes these rows: a client whose gateway died still finds its completion, its response and its conversation.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import faust

from runtime.cassandra_client import connect
from runtime.metrics import CONVERSATION_ITEMS, STORED_COMPLETIONS, STORED_RESPONSES
from runtime.retry import retry_transient
from runtime.settings import Settings
from schemas.codec import codec_for
from schemas.events import StoredCompletion
from schemas.topics import TOPICS
from stream_processors.app import DeadLetters, build_app, raw_topic
from stream_processors.store.completions import CompletionStore
from stream_processors.store.conversations import ConversationStore
from stream_processors.store.responses import ResponseStore
from stream_processors.store.turns import items_of, response_of

log = logging.getLogger(__name__)


def build(settings: Settings) -> faust.App:
    app = build_app(settings, "store", guarantee="exactly_once")
    _cluster, session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)
    sinks = Sinks(CompletionStore(session, settings.cassandra.keyspace),
                  ConversationStore(session, settings.cassandra.keyspace),
                  ResponseStore(session, settings.cassandra.keyspace))
    dead = DeadLetters(app, settings, "store")
    codec = codec_for(StoredCompletion)

    @app.agent(raw_topic(app, settings, TOPICS.stored_completions))
    async def write(stream: Any) -> None:
        async for event in stream.events():
            stored = await dead.decode(codec, event)
            if stored is not None:
                await sinks.write(stored)

    return app


class Sinks:
    """Where one record goes: the stored completions, its conversation, its stored response."""

    def __init__(self, completions: CompletionStore, conversations: ConversationStore,
                 responses: ResponseStore) -> None:
        self._completions = completions
        self._conversations = conversations
        self._responses = responses

    async def write(self, stored: StoredCompletion) -> None:
        request_id = stored.completion_id
        if stored.listed:
            created = await retry_transient(partial(self._completions.write, stored), what="stored completion write")
            STORED_COMPLETIONS.labels(created=str(created).lower()).inc()
            log.info("completion stored", extra={"request_id": request_id, "new_row": created})
        turn = items_of(stored)
        if turn is not None and stored.conversation_id is not None:
            inputs, answer = turn
            for items in (inputs, [answer]):
                await retry_transient(partial(self._conversations.append, stored.conversation_id, items),
                                      what="conversation items write")
            CONVERSATION_ITEMS.inc(len(inputs) + 1)
            log.info("turn appended", extra={"request_id": request_id, "conversation_id": stored.conversation_id,
                                             "items": len(inputs) + 1})
        response = response_of(stored)
        if response is not None:
            created = await retry_transient(partial(self._responses.write, response), what="stored response write")
            STORED_RESPONSES.labels(created=str(created).lower()).inc()
            log.info("response stored", extra={"request_id": request_id, "status": response.status,
                                               "new_row": created})
