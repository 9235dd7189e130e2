"""``GET /v1/models``: the served models with their context length."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from producers.gateway.deps import Caller, Context
from producers.gateway.errors import CALLER_ERRORS, error_responses, model_not_found
from producers.gateway.openapi import links

router = APIRouter(responses=CALLER_ERRORS)


@router.get("/v1/models", operation_id="listModels", responses={
    200: {"description": "The served models.",
          **links(RetrieveModel=("retrieveModel", {"model_id": "$response.body#/data/0/id"}))}})
async def list_models(ctx: Context, _key: Caller) -> dict[str, Any]:
    return {"object": "list", "data": [ctx.prompts.card.as_openai()]}


@router.get("/v1/models/{model_id:path}", operation_id="retrieveModel",
            responses=error_responses({404: "This gateway serves no model of that name."}))
async def get_model(model_id: str, ctx: Context, _key: Caller) -> dict[str, Any]:
    card = ctx.prompts.card
    if model_id != card.served_name:
        raise model_not_found(model_id)
    return card.as_openai()
