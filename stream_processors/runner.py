"""Runs one stream processor: ``kns processor safety|billing|abuse|store``.

The command is a supervisor (``runtime.supervisor``): the Faust worker runs in a child process, and a child that
crashes is started again (with backoff). A fresh process rebuilds its tables from their changelogs; that is also the
way out of faust-streaming's in-process recovery failure after a rebalance ("persisted offset ... higher than the
last offset", faust-streaming#158), which otherwise stops a processor for good. SIGTERM/SIGINT stop the child, then
the supervisor; a SIGKILLed supervisor takes the child along.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from runtime.cpu_priority import yield_to_engines
from runtime.logs import configure_logging
from runtime.settings import load_settings
from runtime.supervisor import exec_supervisor

PROCESSORS = {
    "safety": "stream_processors.safety.processor",
    "billing": "stream_processors.billing_agg.processor",
    "abuse": "stream_processors.abuse.processor",
    "store": "stream_processors.store.processor",
}


def run(name: str) -> None:
    """Become the processor's supervisor (does not return)."""
    exec_supervisor(f"processor-{name}", [sys.executable, "-m", "stream_processors.runner", name])


def work(name: str) -> None:
    """The Faust worker itself (the supervisor's child)."""
    import faust  # here: the supervisor only needs PROCESSORS

    from runtime.kafka_clients import create_missing_topics
    from stream_processors.app import ProcessorApp

    settings = load_settings()
    configure_logging(settings.observability, service=f"processor-{name}")
    yield_to_engines(settings.cpu.yield_nice, f"processor-{name}", session=True)
    app: ProcessorApp = importlib.import_module(PROCESSORS[name]).build(settings)
    # On a thread of its own: the Faust worker owns this thread's event loop from here on.
    with ThreadPoolExecutor(1) as pool:
        created = pool.submit(asyncio.run, create_missing_topics(settings.kafka, app.internal_topics())).result()
    if created:
        logging.getLogger(__name__).info("internal topics created", extra={"topics": created})
    worker = faust.Worker(app, loglevel=logging.getLevelName(logging.getLogger().level), override_logging=False,
                          quiet=True)
    worker.execute_from_commandline()


if __name__ == "__main__":
    work(sys.argv[1])
