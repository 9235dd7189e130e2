"""A deleted stored completion stops replaying (issue 37 L1): its delete forgets its stream (as a response's delete
does), so no gateway resumes it from the log afterwards; another org's or an unknown completion forgets nothing.
The real path (``GET /v1/chat/completions/{id}?stream=true`` answering 404 after the delete) is in
tests/e2e/test_deleted_streams.py."""

from __future__ import annotations

from typing import Any

import pytest

from producers.gateway.errors import ApiError
from producers.gateway.stored import StoredCompletions


class Completions:
    """A CompletionStore over a dict of org ids by completion id."""

    def __init__(self, **owners: str) -> None:
        self.owners = dict(owners)

    async def get(self, completion_id: str, org_id: str) -> dict[str, Any] | None:
        return None

    async def delete(self, completion_id: str, org_id: str) -> bool:
        if self.owners.get(completion_id) != org_id:
            return False
        del self.owners[completion_id]
        return True


class Forgotten(list[str]):
    async def __call__(self, request_id: str) -> None:
        self.append(request_id)


async def test_deleting_a_stored_completion_forgets_its_stream() -> None:
    forgotten = Forgotten()
    stored = StoredCompletions(Completions(chatcmpl_a="org"), forget_stream=forgotten)  # type: ignore[arg-type]
    assert (await stored.delete("chatcmpl_a", "org"))["deleted"]
    assert forgotten == ["chatcmpl_a"]


async def test_deleting_another_orgs_or_an_unknown_completion_forgets_nothing() -> None:
    forgotten = Forgotten()
    stored = StoredCompletions(Completions(chatcmpl_a="org"), forget_stream=forgotten)  # type: ignore[arg-type]
    for completion_id, org in (("chatcmpl_a", "another-org"), ("chatcmpl_b", "org")):
        with pytest.raises(ApiError) as refused:
            await stored.delete(completion_id, org)
        assert refused.value.status == 404
    assert forgotten == []
