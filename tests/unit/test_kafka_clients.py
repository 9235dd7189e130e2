"""The Kafka client factory's choices (pure construction: nothing connects)."""

from __future__ import annotations

from runtime.kafka_clients import make_consumer
from runtime.settings import KafkaSettings


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

