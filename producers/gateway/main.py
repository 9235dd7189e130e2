"""Entry point of one gateway process (``python -m producers.gateway.main``; ``kns gateway`` supervises it)."""

from __future__ import annotations

import uvicorn

from producers.gateway.app import create_app
from runtime.logs import configure_logging
from runtime.settings import load_settings


def run() -> None:
    settings = load_settings()
    configure_logging(settings.observability, service="gateway")
    uvicorn.run(
        create_app(settings),
        host=settings.gateway.host,
        port=settings.gateway.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":  # ``kns gateway`` supervises this
    run()
