"""One turn of a conversation: its history, fitted to the model's context window.

A turn's prompt is the instructions, then the history (a conversation's items, or the chain of responses named by
``previous_response_id``), then the turn's new input. When it cannot fit with room for the answer, the oldest
whole turns of the history are dropped (``truncation: "auto"``), counted exactly with the model's own chat template:
the cut is found by bisection over the turns' boundaries, a few renders however long the history. The instructions
and the new input are never dropped; when even they do not fit, the answer is OpenAI's ``context_length_exceeded``.

The conversation writer appends a turn's items from the log (``stream_processors/store``), a moment after its
answer ends; the next turn of the same conversation waits for them (at most ``gateway.turn_wait_s``). The gateway
notes each conversation's last accepted turn in Redis, and forgets it when that turn ends without being appended
(failed, cancelled, refused) or its client's connection drops (suspended for its resume window: the user may well
move on), so that only a turn still to be written is waited for; a dropped turn resumed and answered is waited for
through its read-your-writes note (``pending_writes.py``), and one answered after the next turn began is appended
after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

from redis.asyncio import Redis
from redis.exceptions import RedisError

from producers.gateway.errors import ApiError, bad_request, unavailable
from producers.gateway.pending_writes import PendingWrites
from producers.gateway.prompt import PromptBuilder
from producers.gateway.stored import STORE_ERRORS
from runtime.metrics import GATEWAY_TRUNCATED_ITEMS, GATEWAY_TURN_WAITS
from runtime.redis_client import key
from runtime.settings import GatewaySettings, RedisSettings
from schemas.events import ChatMessage, ChatRequest, Turn
from schemas.ids import output_item_id
from stream_processors.store.conversations import ConversationStore, Item
from stream_processors.store.responses import ResponseStore, StoredResponse
from stream_processors.store.turns import answered

log = logging.getLogger(__name__)

#: how often a turn looks for its predecessor's items while it waits
POLL_S = 0.1
#: how long a conversation's last accepted turn is remembered (longer than any turn waits for it)
LAST_TURN_TTL_S = 600


@dataclass(frozen=True)
class TurnAsk:
    """What a client asked of one turn."""

    api: str  # "responses" | "chat"
    org_id: str
    new_input: list[ChatMessage]
    conversation_id: str | None = None
    previous_response_id: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    truncation: str = "disabled"
    store: bool = True
    background: bool = False
    #: the request's parameter that names the conversation (errors name it)
    param: str = "conversation"


@dataclass(frozen=True)
class PlannedTurn:
    messages: list[ChatMessage]
    prompt_ids: list[int]
    turn: Turn


def conversation_not_found(conversation_id: str, param: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.", param=param, code="not_found")


def context_exceeded(limit: int, prompt_tokens: int, reserve: int) -> ApiError:
    wanted = f"{prompt_tokens} tokens in the input" + (f" and {reserve} for the output" if reserve else "")
    return bad_request(f"This model's maximum context length is {limit} tokens. However, the request needs "
                       f"{wanted}. Please reduce the length of the input, or use truncation: \"auto\" to drop "
                       "the oldest turns of the conversation.", param="input", code="context_length_exceeded")


class TurnPlanner:
    def __init__(self, prompts: PromptBuilder, conversations: ConversationStore, responses: ResponseStore,
                 redis: Redis, redis_settings: RedisSettings, settings: GatewaySettings, *,
                 in_flight: Callable[[str, str], Awaitable[bool]], pending: PendingWrites | None = None) -> None:
        self._prompts = prompts
        #: a turn some gateway relayed to its end a moment ago, the writer not through yet (read-your-writes)
        self._pending = pending
        self._conversations = conversations
        self._responses = responses
        self._redis = redis
        self._redis_settings = redis_settings
        self._settings = settings
        #: whether a response id names a response of this org still being generated (its stream record lives)
        self._in_flight = in_flight

    @property
    def history_bound(self) -> int:
        """The most history items a turn reads: even a one-token item renders as a few template tokens."""
        return max(self._prompts.card.max_model_len // 3, 1)

    async def plan(self, ask: TurnAsk) -> PlannedTurn:
        try:
            history = await self._history(ask)
        except STORE_ERRORS as exc:
            raise unavailable("Conversations are unavailable right now; retry later.") from exc
        head = [ChatMessage(role="system", content=ask.instructions)] if ask.instructions else []
        messages, prompt_ids, dropped = await self._fit(head, history, ask)
        if dropped:
            GATEWAY_TRUNCATED_ITEMS.inc(dropped)
        turn = Turn(api=ask.api, input_count=len(ask.new_input), instructions=ask.instructions,
                    previous_response_id=ask.previous_response_id, store=ask.store, background=ask.background,
                    truncated_items=dropped, max_output_tokens=ask.max_output_tokens)
        return PlannedTurn(messages, prompt_ids, turn)

    # --- history -------------------------------------------------------------------------------------------

    async def _history(self, ask: TurnAsk) -> list[ChatMessage]:
        if ask.conversation_id is not None:
            if await self._conversations.get(ask.conversation_id, ask.org_id) is None:
                raise conversation_not_found(ask.conversation_id, ask.param)
            await self._await_previous_turn(ask.conversation_id, ask.org_id)
            if self._pending is not None:  # a turn resumed after a drop and answered: its items are on their way
                await self._pending.turn(ask.conversation_id, partial(self._item_written, ask.conversation_id,
                                                                      ask.org_id), _readable)
            items = await self._conversations.history(ask.conversation_id, max_items=self.history_bound)
            return [_message(item) for item in items]
        if ask.previous_response_id is not None:
            return await self._chain(ask.previous_response_id, ask.org_id)
        return []

    async def _await_previous_turn(self, conversation_id: str, org_id: str) -> None:
        try:
            previous = await self._redis.get(self._last_turn_key(conversation_id))
        except (RedisError, OSError):
            previous = None  # unknown: go on with what is written
        if previous is None:
            return
        item_id = output_item_id(str(previous))
        deadline = time.monotonic() + self._settings.turn_wait_s
        while not await self._conversations.written(conversation_id, org_id, item_id):
            if await self._ended_unanswered(str(previous), org_id):
                return  # it failed or was cancelled: it will not be appended
            if time.monotonic() >= deadline:
                GATEWAY_TURN_WAITS.labels(outcome="timed_out").inc()
                log.warning("the previous turn was not written in time; going on without it",
                            extra={"conversation_id": conversation_id, "previous_request_id": previous})
                return
            await asyncio.sleep(POLL_S)
        GATEWAY_TURN_WAITS.labels(outcome="written").inc()

    async def _item_written(self, conversation_id: str, org_id: str, item_id: str) -> bool:
        return await self._conversations.written(conversation_id, org_id, item_id)

    async def _ended_unanswered(self, response_id: str, org_id: str) -> bool:
        """A Responses turn whose row says it ended without an answer to append (a chat turn has no row)."""
        stored = await self._responses.get(response_id, org_id)
        return stored is not None and not answered(stored.status, stored.output_text)

    async def _chain(self, response_id: str, org_id: str) -> list[ChatMessage]:
        """The turns of ``response_id`` and of the responses before it, oldest first, at most the history bound."""
        turns: list[list[ChatMessage]] = []
        count, links = 0, 0
        current: str | None = response_id
        # Every link read counts against the bound, answered or not: a chain of failures is no longer to read.
        while current is not None and count < self.history_bound and links < self.history_bound:
            stored = await self._previous(current, org_id) if not links else await self._responses.get(current, org_id)
            links += 1
            if stored is None:
                break  # an older link expired or was deleted: the history starts after it
            if answered(stored.status, stored.output_text):
                turn = [ChatMessage(role=i["role"], content=i["content"]) for i in stored.input_items]
                turn.append(ChatMessage(role="assistant", content=stored.output_text))
                turns.append(turn)
                count += len(turn)
            current = stored.previous_response_id
        return [message for turn in reversed(turns) for message in turn][-self.history_bound:]

    async def _previous(self, response_id: str, org_id: str) -> StoredResponse:
        """The response a turn follows: waited for while it is still generated (its row is written at its end)."""
        deadline = time.monotonic() + self._settings.turn_wait_s
        while (stored := await self._responses.get(response_id, org_id)) is None:
            if not await self._in_flight(response_id, org_id):
                raise ApiError(404, f"Previous response with id '{response_id}' not found.",
                               param="previous_response_id", code="not_found")
            if time.monotonic() >= deadline:
                raise bad_request(f"Previous response with id '{response_id}' is still in progress; retry once "
                                  "it has completed.", param="previous_response_id",
                                  code="previous_response_in_progress")
            await asyncio.sleep(POLL_S)
        return stored

    # --- fitting -------------------------------------------------------------------------------------------

    async def _fit(self, head: list[ChatMessage], history: list[ChatMessage], ask: TurnAsk
                   ) -> tuple[list[ChatMessage], list[int], int]:
        """The prompt, and how many history items were dropped to fit it."""
        limit = self._prompts.card.max_model_len
        if ask.truncation != "auto":
            # Nothing may be dropped: the engine's own bounds apply (the request's sampling checks them).
            messages = [*head, *history, *ask.new_input]
            return messages, await self._prompts.tokens(messages), 0
        reserve = ask.max_output_tokens or min(self._settings.output_reserve_tokens, limit // 2)
        budget = limit - reserve
        cuts = [i for i, m in enumerate(history) if m.role == "user"] + [len(history)]
        if 0 not in cuts:
            cuts.insert(0, 0)
        best: tuple[list[ChatMessage], list[int], int] | None = None
        lo, hi = 0, len(cuts) - 1  # find the first cut (the most history) whose prompt fits
        while lo <= hi:
            mid = (lo + hi) // 2
            messages = [*head, *history[cuts[mid]:], *ask.new_input]
            ids = await self._prompts.tokens(messages)
            if len(ids) <= budget:
                best, hi = (messages, ids, cuts[mid]), mid - 1
            else:
                lo = mid + 1
        if best is None:
            messages = [*head, *ask.new_input]
            raise context_exceeded(limit, len(await self._prompts.tokens(messages)), reserve)
        return best

    # --- the conversation's last turn (Redis) ---------------------------------------------------------------

    def _last_turn_key(self, conversation_id: str) -> str:
        return key(self._redis_settings, "conversation-turn", conversation_id)

    async def started(self, request: ChatRequest) -> None:
        """A turn of a conversation was accepted: the next turn waits for its items."""
        if request.conversation_id is None:
            return
        try:
            await self._redis.set(self._last_turn_key(request.conversation_id), request.request_id,
                                  ex=LAST_TURN_TTL_S)
        except (RedisError, OSError) as exc:
            log.warning("the conversation's last turn was not noted; its next turn will not wait for it",
                        extra={"request_id": request.request_id, "reason": repr(exc)})

    async def ended_unwritten(self, request_id: str, conversation_id: str) -> None:
        """A turn that ends without being appended (failed, cancelled, refused): nobody waits for it."""
        with contextlib.suppress(RedisError, OSError):  # else the next turn waits turn_wait_s at most
            await self._redis.eval(_FORGET, 1, self._last_turn_key(conversation_id), request_id)


async def _readable() -> None:
    """The conversation's owner was checked already (``_history``)."""


def _message(item: Item) -> ChatMessage:
    # "developer" is OpenAI's newer name for the system role; the chat template knows "system"
    return ChatMessage(role="system" if item.role == "developer" else item.role, content=item.text)


_FORGET = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
