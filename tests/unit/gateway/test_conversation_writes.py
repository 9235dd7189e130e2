"""Conversation writes are admitted and accounted (issue 37 H3): a create or a metadata update is a request of the
key's and the org's limits, admitted before its body is parsed; an item holds at most the gateway's limit; the org's
conversations stay within its tier's storage quota (429 insufficient_quota past it, nothing written).

The store is a fake (the counting is tested on Cassandra in tests/integration/test_conversation_store.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from producers.gateway.conversations import ConversationService
from producers.gateway.errors import ApiError
from producers.gateway.responses_protocol import ConversationCreate
from runtime.settings import TierTable
from schemas.events import LimitOverrides
from stream_processors.store.conversations import (
    CONVERSATION_BYTES,
    ITEM_BYTES,
    Conversation,
    Item,
    conversation_bytes,
    item_bytes,
)
from tests.fakes.tenancy import api_key, local_admission

QUOTA = 10_000


class Store:
    """Conversations in a dict, counted as the real store counts them."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}
        self.conversations: dict[str, Conversation] = {}
        self.items: dict[str, list[Item]] = {}

    async def create(self, conversation: Conversation, items: list[Item]) -> None:
        self.conversations[conversation.conversation_id] = conversation
        self.items[conversation.conversation_id] = items
        self._count(conversation.org_id, conversation_bytes(conversation.metadata) + sum(map(item_bytes, items)))

    async def get(self, conversation_id: str, org_id: str) -> Conversation | None:
        found = self.conversations.get(conversation_id)
        return found if found is not None and found.org_id == org_id else None

    async def update_metadata(self, conversation_id: str, org_id: str,
                              metadata: dict[str, str]) -> Conversation | None:
        found = await self.get(conversation_id, org_id)
        if found is None:
            return None
        self._count(org_id, conversation_bytes(metadata) - conversation_bytes(found.metadata))
        self.conversations[conversation_id] = replace(found, metadata=metadata)
        return self.conversations[conversation_id]

    async def storage_used(self, org_id: str) -> int:
        return self.used.get(org_id, 0)

    def _count(self, org_id: str, size: int) -> None:
        self.used[org_id] = self.used.get(org_id, 0) + size


def service(store: Store, **options: object) -> ConversationService:
    tiers = TierTable.model_validate({"plus": {"conversation_storage_bytes": QUOTA}})
    return ConversationService(store, admission=local_admission(tiers), tiers=tiers, **options)  # type: ignore[arg-type]


def body(**fields: object) -> ConversationCreate:
    return ConversationCreate.model_validate(fields)


def never_parsed() -> ConversationCreate:
    raise AssertionError("the body of a refused write was parsed")


async def test_a_create_is_a_request_of_the_keys_rate_limit_refused_before_its_body_is_parsed() -> None:
    key = api_key(limits=LimitOverrides(requests_per_minute=2))
    conversations = service(Store())
    for _ in range(2):
        await conversations.create(lambda: body(items=[{"role": "user", "content": "hi"}]), key)
    with pytest.raises(ApiError) as refused:
        await conversations.create(never_parsed, key)
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    assert "retry-after" in (refused.value.headers or {})


async def test_a_metadata_update_is_a_request_of_the_keys_rate_limit() -> None:
    key = api_key(limits=LimitOverrides(requests_per_minute=2))
    store = Store()
    conversations = service(store)
    created = await conversations.create(lambda: body(metadata={"topic": "a"}), key)
    await conversations.update(created["id"], lambda: {"topic": "b"}, key)
    with pytest.raises(ApiError) as refused:
        await conversations.update(created["id"], lambda: {"topic": "c"}, key)
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    assert store.conversations[created["id"]].metadata == {"topic": "b"}


async def test_a_write_frees_its_slot_in_flight_when_it_ends() -> None:
    key = api_key(limits=LimitOverrides(max_concurrent=1))
    conversations = service(Store())
    for _ in range(3):  # each would be refused (concurrent) if the one before still held its slot
        await conversations.create(lambda: body(), key)


async def test_an_item_longer_than_the_limit_is_refused_naming_it() -> None:
    store = Store()
    conversations = service(store, item_max_chars=10)
    with pytest.raises(ApiError) as refused:
        await conversations.create(lambda: body(items=[{"role": "user", "content": "short"},
                                                       {"role": "user", "content": "x" * 11}]), api_key())
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400, "string_above_max_length", "items[1].content")
    assert store.conversations == {}


async def test_a_create_past_the_orgs_storage_quota_is_refused_and_writes_nothing() -> None:
    store = Store()
    conversations = service(store)
    text = "x" * 1000
    fits = (QUOTA - CONVERSATION_BYTES) // (ITEM_BYTES + len(text))
    await conversations.create(lambda: body(items=[{"role": "user", "content": text}] * fits), api_key())
    with pytest.raises(ApiError) as refused:
        await conversations.create(lambda: body(items=[{"role": "user", "content": text}]), api_key())
    error = refused.value
    assert (error.status, error.type, error.code) == (429, "insufficient_quota", "storage_quota_exceeded")
    assert "retry-after" not in (error.headers or {}), "waiting does not help"
    assert len(store.conversations) == 1 and store.used["org"] <= QUOTA
    assert await conversations.create(lambda: body(), api_key(org_id="another-org"))  # its own quota


async def test_at_the_quota_metadata_can_shrink_but_not_grow() -> None:
    store = Store()
    conversations = service(store)
    created = await conversations.create(lambda: body(metadata={"topic": "x" * 100}), api_key())
    store.used["org"] = QUOTA
    with pytest.raises(ApiError) as refused:
        await conversations.update(created["id"], lambda: {"topic": "x" * 101}, api_key())
    assert refused.value.code == "storage_quota_exceeded"
    updated = await conversations.update(created["id"], lambda: {"topic": "x"}, api_key())
    assert updated["metadata"] == {"topic": "x"} and store.used["org"] < QUOTA


def test_the_stored_sizes_count_bytes_not_characters() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    assert item_bytes(Item("i", "user", "é", at, 0)) == ITEM_BYTES + 2
    assert conversation_bytes({"k": "é"}) == CONVERSATION_BYTES + 3
