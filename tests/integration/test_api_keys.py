"""The key registry on the real Kafka: only hashes are stored, and a key issued through one process's view
authenticates through another's at once (its miss catches up with the topic's end)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import pytest

from producers.gateway.keys import KEY_PREFIX, hash_key
from producers.tenancy.admin import KeyCreate, KeyRotate, TenancyError, open_admin
from runtime.kafka_clients import all_partitions, make_consumer
from runtime.settings import Settings
from runtime.tenancy import ApiKey, Refusal
from schemas.events import utcnow
from schemas.topics import TOPICS

pytestmark = pytest.mark.integration


async def _raw_records(stack: Settings) -> list[tuple[bytes, bytes]]:
    consumer = make_consumer(stack.kafka, role="test-raw")
    await consumer.start()
    try:
        topic = stack.kafka.topic(TOPICS.keys.name)
        partitions = await all_partitions(consumer, topic)
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: list[tuple[bytes, bytes]] = []
        while any([await consumer.position(tp) < ends[tp] for tp in partitions]):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                out += [(r.key or b"", r.value or b"") for r in records]
        return out
    finally:
        await consumer.stop()


async def test_only_the_hash_is_stored_and_another_view_knows_the_key_at_once(stack: Settings) -> None:
    org = f"org-keys-{uuid.uuid4().hex[:8]}"
    async with open_admin(stack) as writer, open_admin(stack) as gateway:
        issued = await writer.issue_key(org, "free", KeyCreate(name="t"))
        assert issued.secret.startswith(KEY_PREFIX) and len(issued.secret) > 40
        # Hashed here, not with hash_key: the stored hash must be the SHA-256 of the secret.
        digest = hashlib.sha256(issued.secret.encode()).hexdigest()
        assert issued.record.key_hash == digest
        # The other view has not seen the record yet, or has: either way the lookup answers the key.
        found = await gateway.view.authenticate(digest)
        assert isinstance(found, ApiKey) and (found.key_id, found.org_id, found.tier) == (
            issued.record.key_id, org, "free")
        assert await gateway.view.authenticate(hash_key(issued.secret + "x")) is Refusal.UNKNOWN

        revoked = await writer.revoke_key(issued.record.key_id)
        assert revoked.revoked_at is not None
        await gateway.view.catch_up()
        assert await gateway.view.authenticate(digest) is Refusal.REVOKED

    records = [(k, v) for k, v in await _raw_records(stack) if k == digest.encode()]
    assert len(records) == 2, "one record for the key, one for its revocation"
    body = issued.secret.removeprefix(KEY_PREFIX).encode()
    assert not any(body in value or body in key for key, value in records), "the secret is stored"


async def test_registering_a_known_secret_again_never_revives_it(stack: Settings) -> None:
    """Review finding: `stack up` re-registered the dev key file's secret whenever it was not usable, so a
    revoked (leaked) dev key came back on the next start."""
    org = f"org-revive-{uuid.uuid4().hex[:8]}"
    async with open_admin(stack) as admin:
        issued = await admin.issue_key(org, "free")
        await admin.revoke_key(issued.record.key_id)
        assert await admin.register_secret(org, "free", issued.secret, key_id="key_again", name="file") is False
        assert await admin.view.authenticate(issued.record.key_hash) is Refusal.REVOKED


#: what the loser of two concurrent changes hears (see below)
LOSER_CODES = {"concurrent_change", "registry_unavailable"}


async def test_concurrent_changes_to_one_key_are_serialised(stack: Settings) -> None:
    """Review finding: two admins rotating one key at once both kept their new secret live, and a rotation racing
    a revocation brought the key back. Changes are serialised by the registry's transactional id: the loser gets
    409 concurrent_change, and no interleaving leaves more than one live secret, or any after a revocation.
    Kafka 4.3's coordinator sometimes answers the loser's EndTxn with UNKNOWN_SERVER_ERROR instead of a fencing
    (IllegalStateException: ONGOING while PREPARE_EPOCH_FENCE, in endTransactionWithTV1; seen in a CI run): then
    the loser hears 503 registry_unavailable ("retry"), its change aborted all the same."""
    org = f"org-race-{uuid.uuid4().hex[:8]}"
    async with open_admin(stack) as a, open_admin(stack) as b:
        for _ in range(4):
            key_id = (await a.issue_key(org, "free")).record.key_id
            outcomes = await asyncio.gather(a.rotate_key(key_id, KeyRotate()), b.rotate_key(key_id, KeyRotate()),
                                            return_exceptions=True)
            for outcome in outcomes:
                assert not isinstance(outcome, BaseException) or (
                    isinstance(outcome, TenancyError) and outcome.code in LOSER_CODES), outcome
            assert sum(not isinstance(outcome, BaseException) for outcome in outcomes) >= 1  # one of them won
            await a.view.catch_up()
            live = [k for k in a.view.keys_of(key_id) if k.usable_at(utcnow())]
            assert len(live) == 1, f"{len(live)} live secrets after two concurrent rotations"

            outcomes = await asyncio.gather(a.revoke_key(key_id), b.rotate_key(key_id, KeyRotate()),
                                            return_exceptions=True)
            revoked, _ = outcomes
            if isinstance(revoked, BaseException):  # the revocation lost the race: do it again, alone
                assert isinstance(revoked, TenancyError) and revoked.code in LOSER_CODES, revoked
                await a.revoke_key(key_id)
            await a.view.catch_up()
            assert [k for k in a.view.keys_of(key_id) if k.usable_at(utcnow())] == [], "a revoked key came back"
