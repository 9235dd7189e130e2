"""Several supervised copies of one service from one command: ``kns gateway --processes N``.

One Python process serves one core; a host with more cores runs more processes. The fleet starts one supervisor
(``runtime/supervisor.py``) per copy, each with its own environment (the gateway's: its instance id and its own
port, ``producers/gateway/fleet.py``), so a copy that dies is restarted by its own supervisor without touching the
others:

* each supervisor leads a process group of its own and gets ``PR_SET_PDEATHSIG(SIGKILL)``: a terminal's Ctrl-C
  reaches the fleet alone, which passes it on once to every supervisor (a second signal, again: "now"), and a
  SIGKILLed fleet takes its supervisors along (which take their services along);
* a supervisor starts with the signals it takes blocked, and with their default actions: a stop passed on while it is
  still starting waits for it, and one the fleet's own launcher ignored (a background job's SIGINT) still stops it;
* a supervisor that exits while nobody asked it to (a permanent exit code: the configuration is wrong, which is
  wrong for every copy) stops the others; the fleet exits with that code.

Owns: its supervisors. Must not: restart anything itself (that is each supervisor's job).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from runtime.cpu_priority import own_session_env
from runtime.supervisor import STOP_SIGNALS, die_with_parent

log = logging.getLogger(__name__)

_HANDLED = STOP_SIGNALS | {signal.SIGCHLD}


class Fleet:
    def __init__(self, name: str, argv: Sequence[str], envs: Sequence[Mapping[str, str]]) -> None:
        self.name = name
        self.argv = list(argv)
        self.envs = [dict(env) for env in envs]
        self._pid = os.getpid()
        self._running: dict[int, subprocess.Popen[bytes]] = {}

    def _supervisor_command(self, index: int) -> list[str]:
        return [sys.executable, "-m", "runtime.supervisor", f"{self.name}-{index}", "--", *self.argv]

    def _start(self, index: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        parent = self._pid
        return subprocess.Popen(self._supervisor_command(index), stdin=subprocess.DEVNULL,
                                env={**env, **own_session_env()}, process_group=0,
                                preexec_fn=lambda: die_with_parent(parent, _HANDLED, keep_blocked=True))

    def _signal_all(self, sig: int) -> None:
        for child in self._running.values():
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)

    def _reap(self) -> list[int]:
        """Exit codes of the supervisors that exited since the last look."""
        codes = []
        for pid, child in list(self._running.items()):
            code = child.poll()
            if code is not None:
                del self._running[pid]
                codes.append(code)
                log.info("a supervisor exited", extra={"service_name": self.name, "pid": pid, "exit_code": code})
        return codes

    def run(self) -> int:
        """Until every supervisor stopped: 0 when asked to stop and all stopped cleanly, else the first non-zero
        exit code."""
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        for index, env in enumerate(self.envs):
            child = self._start(index, env)
            self._running[child.pid] = child
        log.info("started the fleet", extra={"service_name": self.name, "processes": len(self.envs)})
        stopping = False
        result = 0
        while self._running:
            info = signal.sigwaitinfo(_HANDLED)
            if info.si_signo != signal.SIGCHLD:
                stopping = True
                self._signal_all(info.si_signo)
                continue
            for code in self._reap():
                result = result or code
                if not stopping:  # only a permanent failure ends a supervisor unasked: it is every copy's
                    stopping = True
                    log.critical("a copy cannot run: stopping the fleet",
                                 extra={"service_name": self.name, "exit_code": code})
                    self._signal_all(signal.SIGTERM)
        return result
