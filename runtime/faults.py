"""Fault injection at named points, for chaos runs and fault tests on the real stack.

Off unless ``settings.faults.dir`` is set. A point fires when a file named after it exists in that folder; the
file's content says what happens (``kill``: SIGKILL this process; ``sleep <s>``: block the event loop, as a
stalled process would; ``error``: raise :class:`InjectedFault`) and the file is removed, so one arming fires
once (a supervised process restarted with the same settings does not fire again).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from runtime.settings import FaultSettings

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised at a point armed with ``error``."""


class Faults:
    def __init__(self, settings: FaultSettings) -> None:
        self._dir: Path | None = settings.dir

    @property
    def enabled(self) -> bool:
        return self._dir is not None

    def hit(self, point: str) -> None:
        if self._dir is None:
            return
        path = self._dir / point
        try:
            action = path.read_text().strip()
            path.unlink()
        except FileNotFoundError:
            return
        log.warning("fault injected", extra={"point": point, "action": action})
        if action == "kill":
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        elif action.startswith("sleep"):
            time.sleep(float(action.split()[1]))  # blocking on purpose: the whole process stalls
        elif action == "error":
            raise InjectedFault(point)


def arm(folder: Path, point: str, action: str) -> None:
    """Arm one fault (from a test or ``kns chaos``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / point).write_text(action)


NO_FAULTS = Faults(FaultSettings())
