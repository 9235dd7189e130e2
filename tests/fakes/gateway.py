"""The gateway's use case, built for unit tests: a prompt builder that needs no tokenizer, a clock to move by hand."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from producers.gateway.admission import Admission
from producers.gateway.service import ChatService
from runtime.settings import GatewaySettings, TierPolicy
from schemas.events import SamplingSpec
from tests.fakes.tenancy import local_admission


async def _three_tokens(messages: object) -> list[int]:
    return [1, 2, 3]


#: a PromptBuilder for model "m": every prompt is 3 tokens, every request asks for 8
PROMPTS = SimpleNamespace(card=SimpleNamespace(served_name="m"), render=lambda messages: [1, 2, 3],
                          tokens=_three_tokens, sampling=lambda body, n: SamplingSpec(max_tokens=8))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chat_service(publisher: Any, relay: Any, *, admission: Admission | None = None,
                 tiers: dict[str, TierPolicy] | None = None, **gateway: Any) -> ChatService:
    return ChatService(GatewaySettings(instance_id="gw", **gateway), PROMPTS, publisher, relay, 0,  # type: ignore[arg-type]
                       "gw/1", admission=admission or local_admission(), tiers=tiers)
