"""What Faust itself would give a topic it creates: the reference our own creation of its topics is held to."""

from __future__ import annotations

from typing import Any

from faust.transport.drivers.aiokafka import Transport
from mode.utils.times import want_seconds


def as_faust_creates(topic: Any) -> dict[str, str]:
    """The configs of ``topic`` as Faust's aiokafka driver creates it (``_really_create_topic``): cleanup policy
    and retention from the topic's flags, then the topic's own configs over them."""
    retention = int(want_seconds(topic.retention) * 1000) if topic.retention else None
    config = Transport._topic_config(None, retention, topic.compacting, topic.deleting)  # type: ignore[arg-type]
    config.update(topic.config or {})
    return {key: str(value) for key, value in config.items()}
