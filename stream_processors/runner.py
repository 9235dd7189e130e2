"""Runs one stream processor: ``kns processor safety|billing|abuse``.

The command is a small supervisor: the Faust worker runs in a child process, and a child that crashes is started
again (with backoff). A fresh process rebuilds its tables from their changelogs; that is also the way out of
faust-streaming's in-process recovery failure after a rebalance ("persisted offset ... higher than the last
offset", faust-streaming#158), which otherwise stops a processor for good. SIGTERM/SIGINT stop the child and the
supervisor. Both share a process group, so stopping the group (the stack manager, a SIGKILL) stops both.
"""

from __future__ import annotations

import importlib
import logging
import signal
import subprocess
import sys
import time
from types import FrameType

import faust

from runtime.logs import configure_logging
from runtime.settings import load_settings

PROCESSORS = {
    "safety": "stream_processors.safety.processor",
    "billing": "stream_processors.billing_agg.processor",
    "abuse": "stream_processors.abuse.processor",
}
log = logging.getLogger(__name__)
#: a child that ran at least this long was healthy: the next restart starts again at the shortest backoff
STABLE_S = 60.0


def run(name: str) -> None:
    """Supervise the processor's worker process until asked to stop."""
    settings = load_settings()
    configure_logging(settings.observability, service=f"processor-{name}-supervisor")
    child: subprocess.Popen[bytes] | None = None
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    backoff = 1.0
    while True:
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "stream_processors.runner", name])
        code = child.wait()
        if stopping:
            sys.exit(0)
        backoff = 1.0 if time.monotonic() - started > STABLE_S else min(backoff * 2, 30.0)
        log.error("processor exited; starting it again", extra={"processor": name, "exit_code": code,
                                                                 "restart_in_s": backoff})
        time.sleep(backoff)


def work(name: str) -> None:
    """The Faust worker itself (the supervisor's child)."""
    settings = load_settings()
    configure_logging(settings.observability, service=f"processor-{name}")
    app: faust.App = importlib.import_module(PROCESSORS[name]).build(settings)
    worker = faust.Worker(app, loglevel=logging.getLevelName(logging.getLogger().level), override_logging=False,
                          quiet=True)
    worker.execute_from_commandline()


if __name__ == "__main__":
    work(sys.argv[1])
