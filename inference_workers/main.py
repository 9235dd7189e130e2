"""Entry point of one inference worker process: ``kns worker``."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from inference_workers.engine import VllmEngine
from inference_workers.protocol import EngineClient, EngineDeadError
from inference_workers.synthetic import SyntheticEngine
from inference_workers.worker import Worker
from runtime.logs import configure_logging
from runtime.settings import Settings, load_settings
from schemas.errors import FatalError

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> None:
    # Blocking on purpose: nothing else runs before the engine is up (health answers only after).
    engine: EngineClient
    if settings.engine.kind == "synthetic":
        engine = SyntheticEngine(settings.engine)
    else:
        engine = VllmEngine.start(settings.model, settings.engine)
    worker = Worker(settings, engine)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop_requested.set)
    try:
        await worker.run()
    finally:
        engine.shutdown()


def run() -> None:
    settings = load_settings()
    configure_logging(settings.observability, service="worker")
    try:
        asyncio.run(serve(settings))
    except (EngineDeadError, FatalError) as exc:
        log.critical("worker stopping", extra={"reason": repr(exc)})
        sys.exit(2)
