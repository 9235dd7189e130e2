"""Entry point of one inference worker process (``python -m inference_workers.main``; ``kns worker`` supervises it).

Exit codes (``runtime.supervisor`` decides on them): 2 when the engine died or the worker cannot go on (restarted),
``os.EX_CONFIG`` when the model folder is missing (not restarted: a restart would fail the same way).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from inference_workers.engine import VllmEngine
from inference_workers.protocol import EngineClient, EngineDeadError
from inference_workers.synthetic import SyntheticEngine, engine_phase
from inference_workers.worker import Worker
from runtime import event_loop, gc_pauses
from runtime.cpu_priority import yield_to_engines
from runtime.logs import configure_logging
from runtime.reaper import start_reaper
from runtime.settings import Settings, load_settings
from schemas.errors import FatalError

log = logging.getLogger(__name__)


async def serve(settings: Settings) -> None:
    # Blocking on purpose: nothing else runs before the engine is up (health answers only after).
    engine: EngineClient
    if settings.engine.kind == "synthetic":
        engine = SyntheticEngine(settings.engine, phase=engine_phase(settings.worker.instance_id))
    else:
        engine = VllmEngine.start(settings.model, settings.engine)
    # Only now: the engine's processes, started above, keep nice 0 (a thread inherits its creator's level).
    yield_to_engines(settings.cpu.yield_nice, "worker", session=False)  # its session holds the engine
    worker = Worker(settings, engine)
    gc_pauses.watch()
    gc_pauses.freeze_startup()
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
    if settings.engine.kind == "vllm":
        if not (settings.model.path / "config.json").is_file():
            log.critical("no model to serve", extra={"path": str(settings.model.path),
                                                      "hint": "kns model prepares it"})
            sys.exit(os.EX_CONFIG)
        # NOTE cleanup ownership: vLLM's engine-core process does not watch this one. The reaper, started before
        # it, stops the engine (and anything else we started) once this process is gone, even by SIGKILL.
        start_reaper("worker-reaper")
    try:
        event_loop.run(serve(settings), settings.cpu.event_loop)
    except (EngineDeadError, FatalError) as exc:
        log.critical("worker stopping", extra={"reason": repr(exc)})
        sys.exit(2)


if __name__ == "__main__":  # a __main__ guard: vLLM's engine core is spawned and imports this module again
    run()
