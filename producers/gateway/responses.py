"""The Responses API use case: a response is a chat request that carries a :class:`schemas.events.Turn`.

It goes through the same admission (rate limits, budget), work queue, worker, billing and resume mechanism as a
chat completion (:class:`ChatService`); only its prompt (``turns.py``: a conversation's history or a
``previous_response_id`` chain, fitted to the context) and its wire format (``producers/relay/responses_sse.py``)
differ. The worker records the turn in the transaction of its final event; the store processor writes the
response row and the conversation's items from that record, never the gateway.

A background response is generated to its end whoever listens (workers never cancel it as unattended): its create
answers at once (``queued``), and its client polls ``GET /v1/responses/{id}``, resumes its stream on any gateway
(``?stream=true&starting_after=N``), or cancels it. While it runs, its state comes from its stream record; once
it ended, from its stored row.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import orjson

from producers.gateway.admission import Ticket
from producers.gateway.conversations import item_object
from producers.gateway.errors import ApiError, unavailable
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.prompt import PromptBuilder, replayable_seed
from producers.gateway.publisher import EventPublisher
from producers.gateway.responses_protocol import (
    ResponseCreate,
    ResponseView,
    ending,
    message_item,
    response_object,
    usage_of,
)
from producers.gateway.service import Accepted, ChatService, HandedOver, finished_already, generation_failed
from producers.gateway.stored import STORE_ERRORS, list_page
from producers.gateway.turns import TurnAsk, TurnPlanner, context_exceeded
from producers.relay.collector import Delta
from producers.relay.responses_sse import OPENING, ResponseStream
from runtime.metrics import GATEWAY_HANDOVERS
from runtime.tenancy import ApiKey
from schemas.events import ErrorCode, SamplingSpec, utcnow
from schemas.ids import RESPONSE_PREFIX, input_item_id, new_response_id, output_item_id, plausible
from stream_processors.store.conversations import Item
from stream_processors.store.responses import ResponseStore, StoredResponse

log = logging.getLogger(__name__)

#: how long a cancel waits for the response's row, to answer how it really ended
CANCEL_WAIT_S = 5.0
POLL_S = 0.1
#: how often a background response's held slot looks for its end, and for how long at most (its lease's length)
HOLD_POLL_S = 1.0
HOLD_LIMIT_S = 900.0


def response_not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


class ResponsesService:
    def __init__(self, chat: ChatService, prompts: PromptBuilder, turns: TurnPlanner, responses: ResponseStore,
                 publisher: EventPublisher, pending: PendingWrites | None = None) -> None:
        self._chat = chat
        self._pending = pending
        self._prompts = prompts
        self._turns = turns
        self._responses = responses
        self._publisher = publisher
        #: background responses whose in-flight slot this gateway holds until they end
        self._holding: set[asyncio.Task[None]] = set()

    # --- create --------------------------------------------------------------------------------------------

    async def create(self, body: ResponseCreate, key: ApiKey, *, client_addr: str | None,
                     traceparent: str) -> tuple[Accepted, ResponseView]:
        received_at = time.perf_counter()
        self._chat.check_model(body.model, key)
        with self._chat.preparing(key):  # a throttled key buys no history read, no chain walk, no turn wait
            return await self._create(body, key, client_addr=client_addr, traceparent=traceparent,
                                      received_at=received_at)

    async def _create(self, body: ResponseCreate, key: ApiKey, *, client_addr: str | None, traceparent: str,
                      received_at: float) -> tuple[Accepted, ResponseView]:
        response_id = new_response_id()
        json_schema = await self._chat.output_schema(body.output_schema)
        text_format = body.text_format.echo() if body.text_format is not None else None
        planned = await self._turns.plan(TurnAsk(
            api="responses", org_id=key.org_id, new_input=body.input_messages(),
            conversation_id=body.conversation_id, previous_response_id=body.previous_response_id,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            truncation=body.truncation or "disabled", store=body.store, background=body.background))
        sampling = self._sampling(body, len(planned.prompt_ids), json_schema)
        turn = planned.turn.model_copy(update={
            "truncation": body.truncation or "disabled", "temperature": sampling.temperature, "top_p": sampling.top_p,
            "text_format": None if text_format is None else orjson.dumps(text_format).decode()})
        request = self._chat.new_request(
            response_id, key, body.model, planned.messages, planned.prompt_ids, sampling, stream=body.stream,
            conversation_id=body.conversation_id, user=body.user, client_addr=client_addr,
            metadata=body.metadata or {}, turn=turn)
        view = ResponseView(
            id=response_id, created_at=int(time.time()), model=body.model, output_item_id=output_item_id(response_id),
            instructions=body.instructions, previous_response_id=body.previous_response_id,
            conversation_id=body.conversation_id, background=body.background, store=body.store,
            max_output_tokens=body.max_output_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            truncation=turn.truncation, truncated_items=turn.truncated_items,
            metadata=body.metadata or {}, user=body.user, text_format=text_format,
            input_items=[{"role": m.role, "content": m.content} for m in body.input_messages()])
        accepted = await self._chat.submit(request, key, traceparent=traceparent, received_at=received_at,
                                           extra=view.to_json())
        if body.conversation_id is not None:
            self._chat.spawn(self._turns.started(request))
        return accepted, view

    def _sampling(self, body: ResponseCreate, prompt_tokens: int, json_schema: str | None) -> SamplingSpec:
        limit = self._prompts.card.max_model_len
        wanted = body.max_output_tokens
        if prompt_tokens >= limit or (wanted is not None and prompt_tokens + wanted > limit):
            raise context_exceeded(limit, prompt_tokens, wanted or 0)
        temperature = 1.0 if body.temperature is None else body.temperature
        return SamplingSpec(max_tokens=wanted if wanted is not None else limit - prompt_tokens,
                            temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                            seed=replayable_seed(None, temperature, json_schema), json_schema=json_schema)

    def queued(self, accepted: Accepted, view: ResponseView) -> dict[str, Any]:
        """A background response's create answers at once; the generation goes on without this connection."""
        self._detach(accepted, view, stream=False)
        return response_object(view, "queued")

    def _detach(self, accepted: Accepted, view: ResponseView, *, stream: bool) -> None:
        ticket = self._chat.detach(accepted, stream=stream)
        if ticket is not None:
            task = asyncio.ensure_future(self._hold(ticket, view.id, accepted))
            self._holding.add(task)
            task.add_done_callback(self._holding.discard)

    async def _hold(self, ticket: Ticket, response_id: str, accepted: Accepted) -> None:
        """Keep a background response's in-flight slot (``max_concurrent`` counts it as any request) until its row
        says it ended; a gateway that stops meanwhile leaves the slot to lapse with its lease."""
        used: int | None = None
        deadline = time.monotonic() + HOLD_LIMIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(HOLD_POLL_S)
            try:
                stored = await self._responses.ended(response_id)  # a row deleted since still says it ended
            except STORE_ERRORS:
                continue
            if stored is not None:
                used = stored.prompt_tokens + stored.completion_tokens
                break
        await self._chat.end_ticket(ticket, used)

    def stop(self) -> None:
        """The gateway stops: the slots it holds lapse with their lease."""
        for task in self._holding:
            task.cancel()

    # --- answer --------------------------------------------------------------------------------------------

    async def stream(self, accepted: Accepted, view: ResponseView, *, starting_after: int = -1
                     ) -> AsyncIterator[bytes]:
        """The response's events after ``starting_after``. A client that leaves cancels the generation, unless
        it runs in the background; a gateway that stops hands the stream over (:class:`HandedOver`)."""
        fmt = ResponseStream(view, starting_after=starting_after)
        outcome = "cancelled"
        parts: list[str] = []
        try:
            opening = fmt.opening()
            if opening:
                yield opening
            while True:
                delta = await self._chat.next_delta(accepted)
                if delta.error_code == ErrorCode.GATEWAY_STOPPING:
                    outcome = "handed_over"
                    GATEWAY_HANDOVERS.inc()
                    raise HandedOver(accepted.request_id)
                if accepted.background and delta.finished and not delta.from_worker:
                    # This gateway gave up on the stream (a timeout, an event it cannot read), not the generation:
                    # it goes on, and its client polls or resumes it.
                    outcome = "detached"
                    return
                if delta.text:
                    parts.append(delta.text)
                    chunk = fmt.delta(delta.text, delta.position)
                    if chunk:
                        yield chunk
                if not delta.finished:
                    continue
                status, reason = ending(delta.finish_reason, delta.error)
                outcome = "error" if status == "failed" else (delta.finish_reason or "stop")
                text = "".join(accepted.collector.skipped_parts) + "".join(parts)
                yield fmt.ending(delta.position + 1, text, status, incomplete_reason=reason,
                                 usage=_usage(delta), error=_error(delta) if status == "failed" else None,
                                 completed_at=int(time.time()) if status == "completed" else None)
                return
        finally:
            if accepted.background and outcome in ("cancelled", "detached", "handed_over"):
                self._detach(accepted, view, stream=True)  # the client left a background response: it goes on
            else:
                self._chat.close(accepted, outcome, stream=True)

    async def complete(self, accepted: Accepted, view: ResponseView) -> dict[str, Any]:
        """The whole response as one object (failures as the chat API's errors)."""
        parts: list[str] = []
        outcome = "cancelled"
        try:
            while True:
                delta = await self._chat.next_delta(accepted)
                parts.append(delta.text)
                if delta.finished:
                    break
            status, reason = ending(delta.finish_reason, delta.error)
            if status == "failed":
                outcome = "error"
                raise generation_failed(delta)
            outcome = delta.finish_reason or "stop"
            text = "".join(parts)
            item = message_item(view.output_item_id, text, "completed" if status == "completed" else "incomplete")
            return response_object(view, status, output=[item], usage=_usage(delta), incomplete_reason=reason,
                                   completed_at=int(time.time()) if status == "completed" else None)
        finally:
            self._chat.close(accepted, outcome, stream=False)

    # --- read, resume, cancel, delete ----------------------------------------------------------------------

    async def get(self, response_id: str, key: ApiKey) -> dict[str, Any]:
        # Read-your-writes: a response that ended a moment ago is waited for until the writer stored it
        read = partial(self._row, response_id, key)
        stored = await (self._pending.row(response_id, key.org_id, read) if self._pending is not None else read())
        if stored is not None:
            return stored_body(stored)
        return response_object(await self._running(response_id, key), "in_progress")

    async def input_items(self, response_id: str, key: ApiKey, *, after: str | None, limit: int,
                          ascending: bool) -> dict[str, Any]:
        """A page of the response's new input (OpenAI's ``responses.input_items.list``): from its stored row, or from
        its stream's record while it is still being generated."""
        read = partial(self._row, response_id, key)
        stored = await (self._pending.row(response_id, key.org_id, read) if self._pending is not None else read())
        inputs = stored.input_items if stored is not None else (await self._running(response_id, key)).input_items
        at = utcnow()
        items = [Item(input_item_id(response_id, i), m["role"], m["content"], at, i) for i, m in enumerate(inputs)]
        if not ascending:
            items.reverse()
        if after is not None:
            ids = [item.item_id for item in items]
            if after not in ids:
                raise ApiError(404, f"No input item with id '{after}' in this response.", param="after",
                               code="not_found")
            items = items[ids.index(after) + 1:]
        return list_page([item_object(item) for item in items[:limit]], len(items) > limit)

    async def resume(self, response_id: str, key: ApiKey, *, starting_after: int, traceparent: str
                     ) -> tuple[Accepted, ResponseView]:
        """The rest of a response's stream, after the event numbered ``starting_after``, on any gateway."""
        if not plausible(response_id, RESPONSE_PREFIX):
            raise response_not_found(response_id)
        accepted = await self._chat.resume(response_id, starting_after - OPENING, key, traceparent=traceparent,
                                           responses=True)
        assert accepted.record is not None
        view = ResponseView.from_json(accepted.record.extra)
        accepted.background = view.background
        return accepted, view

    async def cancel(self, response_id: str, key: ApiKey, *, traceparent: str) -> dict[str, Any]:
        stored = await self._row(response_id, key)
        if stored is None:
            view = await self._running(response_id, key, stored_only=False)
            if not view.background:
                # Ours (OpenAI cancels background responses only): a streamed response whose client dropped goes on
                # for its resume window, and a client that wants it stopped says so here.
                await self._chat.cancel_stream(response_id, key, traceparent=traceparent, responses=True)
                return response_object(view, "cancelled")
            try:
                await self._publisher.cancel(response_id, "cancelled by its client", traceparent)
            except Exception as exc:
                raise unavailable("The cancel could not be sent; retry.") from exc
            stored = await self._await_row(response_id, key)
            if stored is None:
                return response_object(view, "cancelled")
        if not stored.background:
            raise finished_already(response_id, responses=True)  # as before the writer stored it: one answer
        return stored_body(stored)  # it ended before the cancel took: as it ended

    async def delete(self, response_id: str, key: ApiKey) -> dict[str, Any]:
        if not plausible(response_id, RESPONSE_PREFIX):
            raise response_not_found(response_id)
        try:
            deleted = await self._responses.delete(response_id, key.org_id)
        except STORE_ERRORS as exc:
            raise unavailable("Stored responses are unavailable right now; retry later.") from exc
        if not deleted:
            if await self._in_progress(response_id, key):
                raise ApiError(409, f"Response '{response_id}' is still in progress; cancel it (background) or "
                                    "wait for it to end before deleting it.", param="response_id",
                               code="response_in_progress")
            raise response_not_found(response_id)
        # Unreadable at once everywhere: its stream, still resumable from the log for a while, no longer is.
        await self._chat.forget_stream(response_id)
        if self._pending is not None:
            await self._pending.forget(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def _row(self, response_id: str, key: ApiKey) -> StoredResponse | None:
        if not plausible(response_id, RESPONSE_PREFIX):
            raise response_not_found(response_id)
        try:
            return await self._responses.get(response_id, key.org_id)
        except STORE_ERRORS as exc:
            raise unavailable("Stored responses are unavailable right now; retry later.") from exc

    async def _running(self, response_id: str, key: ApiKey, *, stored_only: bool = True) -> ResponseView:
        """A stored response still being generated (its stream record lives); 404 otherwise. ``stored_only=False``:
        a ``store: false`` one too (its client may still stop it)."""
        record = await self._chat.stream_record(response_id)
        if record is None or not key.may_see(record.org_id, record.model) or not record.extra:
            raise response_not_found(response_id)
        view = ResponseView.from_json(record.extra)
        if stored_only and not view.store:
            raise response_not_found(response_id)  # not stored: never readable by id, as OpenAI's
        return view

    async def _in_progress(self, response_id: str, key: ApiKey) -> bool:
        try:
            await self._running(response_id, key)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise  # the stream registry is down: 503, not "not found"
        return True

    async def _await_row(self, response_id: str, key: ApiKey) -> StoredResponse | None:
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            stored = await self._row(response_id, key)
            if stored is not None:
                return stored
        return None


def stored_body(stored: StoredResponse) -> dict[str, Any]:
    view = ResponseView(
        id=stored.response_id, created_at=int(stored.created_at.timestamp()), model=stored.model,
        output_item_id=output_item_id(stored.response_id), instructions=stored.instructions,
        previous_response_id=stored.previous_response_id, conversation_id=stored.conversation_id,
        background=stored.background, store=True, max_output_tokens=stored.max_output_tokens,
        temperature=stored.temperature, top_p=stored.top_p,
        truncation=stored.truncation, truncated_items=stored.truncated_items,
        metadata=dict(stored.metadata), user=stored.user,
        text_format=None if stored.text_format is None else orjson.loads(stored.text_format))
    answered = stored.status in ("completed", "incomplete")
    output = [message_item(view.output_item_id, stored.output_text, stored.status)] if answered else []
    error = {"code": "server_error", "message": stored.error} if stored.status == "failed" else None
    completed_at = stored.completed_at or stored.created_at
    return response_object(view, stored.status, output=output, error=error,
                           usage=usage_of(stored.prompt_tokens, stored.completion_tokens, stored.cached_tokens),
                           incomplete_reason=stored.incomplete_reason,
                           completed_at=int(completed_at.timestamp()) if stored.status == "completed" else None)


def _usage(delta: Delta) -> dict[str, Any] | None:
    if delta.usage is None:
        return None
    return usage_of(delta.usage.prompt_tokens, delta.usage.completion_tokens, delta.usage.cached_tokens)


def _error(delta: Delta) -> dict[str, Any]:
    failure = generation_failed(delta)
    return {"code": failure.code or "server_error", "message": failure.message}
