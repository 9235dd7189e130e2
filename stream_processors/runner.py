"""Runs one stream processor as a Faust worker: ``kns processor safety|billing|abuse``."""

from __future__ import annotations

import importlib
import logging

import faust

from runtime.logs import configure_logging
from runtime.settings import load_settings

PROCESSORS = {
    "safety": "stream_processors.safety.processor",
    "billing": "stream_processors.billing_agg.processor",
    "abuse": "stream_processors.abuse.processor",
}


def run(name: str) -> None:
    settings = load_settings()
    configure_logging(settings.observability, service=f"processor-{name}")
    app: faust.App = importlib.import_module(PROCESSORS[name]).build(settings)
    worker = faust.Worker(app, loglevel=logging.getLevelName(logging.getLogger().level), override_logging=False,
                          quiet=True)
    worker.execute_from_commandline()
