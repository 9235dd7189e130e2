"""Kafka record headers the platform sets besides the Avro body.

A request record also says, in plain headers, which request it is and where its client waits: a consumer that
cannot decode the body (a schema it does not know yet, a corrupt record) can still tell the client at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

REQUEST_ID = "kns-request-id"
REPLY_PARTITION = "kns-reply-partition"

#: as aiokafka gives them (pairs) or as Faust may (a mapping)
Headers = Sequence[tuple[str, bytes]] | Mapping[str, bytes]


def request_headers(request_id: str, reply_partition: int) -> list[tuple[str, bytes]]:
    return [(REQUEST_ID, request_id.encode()), (REPLY_PARTITION, str(reply_partition).encode())]


def header(headers: Headers | None, name: str) -> str | None:
    pairs = headers.items() if isinstance(headers, Mapping) else headers or ()
    for key, value in pairs:
        if key == name:
            try:
                return value.decode()
            except UnicodeDecodeError:
                return None
    return None


def reply_address(headers: Headers | None) -> tuple[str, int] | None:
    """(request id, reply partition) from a request record's headers, when both are there and well formed."""
    request_id, partition = header(headers, REQUEST_ID), header(headers, REPLY_PARTITION)
    if not request_id or partition is None or not partition.isdigit():
        return None
    return request_id, int(partition)
