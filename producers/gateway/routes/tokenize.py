"""``POST /tokenize`` and ``POST /detokenize``: thin adapters over :class:`Tokenization`, at the paths vLLM's server
uses (beside ``/v1``, not under it), so a client written for vLLM finds them unchanged."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import CALLER_ERRORS, READ_LIMITED, error_responses
from producers.gateway.protocol import openapi_schema
from producers.gateway.routes.chat import bearer, parse_json
from producers.gateway.tokenize_protocol import (
    Detokenize,
    Detokenized,
    TokenizeBody,
    TokenizeChat,
    Tokenized,
    TokenizePrompt,
)

router = APIRouter(dependencies=[Depends(bearer)], responses=CALLER_ERRORS)

_MODEL = {404: "A `model` this gateway does not serve.",
          403: "A `model` the API key may not use, or a suspended key."}


def _body(model: type[Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": openapi_schema(model)}}}}


def parse_tokenize(raw: bytes) -> TokenizeChat | TokenizePrompt:
    """Either form of ``/tokenize``'s body, chosen by ``messages`` (as ``parse_json`` reads one model)."""
    return parse_json(raw, TokenizeBody).root


@router.post("/tokenize", operation_id="tokenize", openapi_extra=_body(TokenizeBody), response_model=Tokenized,
             responses=error_responses({400: "A malformed body.", **_MODEL}) | READ_LIMITED)
async def tokenize(request: Request, ctx: Context, key: Caller) -> Tokenized:
    """A prompt's token ids (``prompt``), or a chat's rendered with the model's chat template (``messages``)."""
    raw = await request.body()
    return await ctx.tokenization.tokenize(key, lambda: parse_tokenize(raw), size=len(raw))


@router.post("/detokenize", operation_id="detokenize", openapi_extra=_body(Detokenize), response_model=Detokenized,
             responses=error_responses({400: "A malformed body, or a token id the model's vocabulary lacks.",
                                        **_MODEL}) | READ_LIMITED)
async def detokenize(request: Request, ctx: Context, key: Caller) -> Detokenized:
    """The text of token ids, special tokens included."""
    raw = await request.body()
    return await ctx.tokenization.detokenize(key, lambda: parse_json(raw, Detokenize), size=len(raw))
