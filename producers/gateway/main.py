"""Entry point of one gateway process (``python -m producers.gateway.main``; ``kns gateway`` supervises it)."""

from __future__ import annotations

import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from producers.gateway.app import create_app
from producers.gateway.service import HandedOver
from runtime.cpu_priority import yield_to_engines
from runtime.logs import configure_logging
from runtime.settings import load_settings


class GatewayServer(uvicorn.Server):
    """uvicorn's server, telling the app when a stop signal arrives: streams are handed over before the server
    waits for open connections to close (``ChatService.hand_over``)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        on_exit = getattr(self._app.state, "on_exit", None)
        if on_exit is not None and not self.should_exit:
            on_exit()
        super().handle_exit(sig, frame)


class _HandoverFilter(logging.Filter):
    """A handed-over stream ends by an exception on purpose (it closes the connection): not an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, HandedOver):
                return False
            group = getattr(exc, "exceptions", None)
            exc = group[0] if group else exc.__cause__ or exc.__context__
        return True


def bound_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """Bound, not listening: the server listens once the app has started, so that until then the kernel sends a
    shared port's connections to the processes that serve (and a port taken by another program fails at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run() -> None:
    settings = load_settings()
    configure_logging(settings.observability, service="gateway")
    yield_to_engines(settings.cpu.yield_nice, "gateway", session=True)
    logging.getLogger("uvicorn.error").addFilter(_HandoverFilter())
    app = create_app(settings)
    own = settings.gateway
    # uvicorn's defaults are for a handful of connections; a gateway holds thousands of idle streams.
    config = uvicorn.Config(app, host=own.host, port=own.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=10, backlog=4096)
    sockets = [bound_socket(own.host, own.port, reuse_port=own.reuse_port),
               bound_socket(own.internal_host, own.internal_port, reuse_port=False)]
    GatewayServer(config, app).run(sockets=sockets)


if __name__ == "__main__":  # ``kns gateway`` supervises this
    run()
