"""Keeps one service process running: ``kns worker``, ``kns gateway`` and ``kns processor NAME`` are supervisors.

The service runs as the supervisor's only child, in a process group of its own:

* a child that dies is started again, after 1 s, doubling for each quick failure in a row up to 30 s, and back to
  1 s once a run lasted 60 s. An exit code that says restarting cannot help (:data:`PERMANENT_EXIT_CODES`: the
  configuration or the command line is wrong) stops the supervisor with that code instead. Everything else is
  restarted, exit 0 included: a service exits only when asked to, and the one that asks is this supervisor;
* SIGTERM, SIGINT and SIGHUP go to the child alone (once: signals to the supervisor's group no longer reach it
  twice), which shuts its own subprocesses down; a child still running after ``stop_timeout_s``, or a second
  signal, gets SIGKILL on its whole group;
* the child gets ``PR_SET_PDEATHSIG(SIGKILL)``: a SIGKILLed supervisor takes it along (and the worker's reaper,
  ``runtime.reaper``, takes its engine processes along);
* the supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``): what a dead child leaves behind (vLLM's engine
  core) is re-parented to it, and is stopped and reaped before the next child starts, so a restarted worker
  never meets its predecessor's engine on the GPU.

Signals are handled synchronously (blocked, then taken with ``sigtimedwait``): none is lost between a child's exit
and the decision to restart it, nor during the restart delay. The child gets them with their default actions: one
that whoever started the supervisor ignored (a background job's SIGINT) still reaches it.

Owns: one child and whatever that child leaves behind. Must not: signal anything outside its own process tree.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.cpu_priority import own_session_env
from runtime.reaper import descendants, terminate

log = logging.getLogger(__name__)

#: exit codes that say restarting cannot help (sysexits.h): the command line or the configuration is wrong
PERMANENT_EXIT_CODES = {os.EX_USAGE: "wrong command line", os.EX_CONFIG: "wrong configuration"}
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
_HANDLED = STOP_SIGNALS | {signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    #: a child that ran at least this long was healthy: the next restart starts again at ``first_delay_s``
    stable_after_s: float = 60.0
    #: after a stop signal the child gets this long (the worker drains its requests) before SIGKILL
    stop_timeout_s: float = 30.0
    #: what a dead child left behind gets SIGTERM, then SIGKILL after this long
    orphan_grace_s: float = 10.0


_libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls into it


def _prctl(option: int, value: int) -> None:
    if _libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def die_with_parent(parent_pid: int, handled: set[signal.Signals], *, keep_blocked: bool = False) -> None:
    """Runs in a child between fork and exec: it dies with its parent (SIGKILL), and the signals the parent takes
    itself (``handled``: blocked, taken with ``sigwaitinfo``) get their default action back and, unless
    ``keep_blocked``, are unblocked.

    Both survive exec otherwise: the mask, and an ignored signal. A parent started with SIGINT ignored (a background
    job of a non-interactive shell is) still takes a SIGINT, as it is blocked, but its child would drop the one passed
    on to it. ``keep_blocked`` is for a child that takes them synchronously too (a supervisor): one sent before it is
    ready then waits for it, instead of killing it half-started, or being dropped."""
    for sig in handled:  # still blocked here: none arrives before its default action is back
        signal.signal(sig, signal.SIG_DFL)
    if not keep_blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


class Supervisor:
    def __init__(self, name: str, argv: Sequence[str], policy: RestartPolicy = RestartPolicy()) -> None:
        self.name = name
        self.argv = list(argv)
        self.policy = policy
        self._pid = os.getpid()
        self._child: subprocess.Popen[bytes] | None = None
        self._stopping: signal.Signals | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        parent = self._pid
        child = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, process_group=0,
                                 env={**os.environ, **own_session_env()},
                                 preexec_fn=lambda: die_with_parent(parent, _HANDLED))
        log.info("started the service", extra={"service_name": self.name, "pid": child.pid})
        return child

    def _reap(self) -> int | None:
        """Reap every exited child (adopted orphans too). The exit code of the service's child if it exited."""
        code = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if self._child is not None and pid == self._child.pid:
                code = os.waitstatus_to_exitcode(status)
                self._child.returncode = code  # Popen must not wait for a pid we reaped
        return code

    def _stop_leftovers(self) -> None:
        """Stop and reap what the dead child left behind: re-parented to us, as we are a subreaper."""
        for _ in range(3):  # a leftover may start a process while we stop it: look again
            leftovers = descendants(self._pid)
            if not leftovers:
                return
            log.warning("stopping what the service left behind",
                        extra={"service_name": self.name, "pids": [p.pid for p in leftovers]})
            terminate(leftovers, roots=[p for p in leftovers if p.ppid == self._pid],
                      grace_s=self.policy.orphan_grace_s, tick=self._reap)
            self._reap()

    def _signal_child(self, sig: int, *, group: bool = False) -> None:
        if self._child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(self._child.pid, sig)  # the child leads its own group
            else:
                self._child.send_signal(sig)

    def run(self) -> int:
        """Supervise until asked to stop (then 0, or 137 if the child had to be killed) or until the child exits
        with a permanent exit code (then that code)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        delay = 0.0
        next_start = time.monotonic()
        started = 0.0
        stop_deadline = 0.0
        killed = False
        while True:
            now = time.monotonic()
            timeout: float | None = None
            if self._child is None:
                if self._stopping is not None:
                    return 0
                if now >= next_start:
                    try:
                        self._child = self._start()
                    except OSError as exc:  # no memory or no pid to fork with: that may pass
                        delay = min(max(delay * 2, self.policy.first_delay_s), self.policy.max_delay_s)
                        next_start = now + delay
                        log.error("could not start the service", extra={"service_name": self.name,
                                                                        "error": repr(exc), "retry_in_s": delay})
                    started = now
                    continue
                timeout = next_start - now
            elif self._stopping is not None and not killed:
                if now >= stop_deadline:
                    log.error("the service did not stop in time: killing it",
                              extra={"service_name": self.name, "timeout_s": self.policy.stop_timeout_s})
                    self._signal_child(signal.SIGKILL, group=True)
                    killed = True
                    continue
                timeout = stop_deadline - now
            info = signal.sigwaitinfo(_HANDLED) if timeout is None else signal.sigtimedwait(_HANDLED, timeout)
            if info is None:
                continue
            if info.si_signo != signal.SIGCHLD:
                # 1. A stop signal: pass it on once; a second one means "now".
                if self._stopping is None:
                    self._stopping = signal.Signals(info.si_signo)
                    stop_deadline = time.monotonic() + self.policy.stop_timeout_s
                    log.info("stopping the service", extra={"service_name": self.name,
                                                            "signal": self._stopping.name})
                    self._signal_child(signal.SIGTERM if info.si_signo == signal.SIGHUP else info.si_signo)
                elif not killed:
                    self._signal_child(signal.SIGKILL, group=True)
                    killed = True
                continue
            # 2. SIGCHLD: reap; nothing more to do unless it was the service itself.
            code = self._reap()
            if code is None:
                continue
            uptime = time.monotonic() - started
            pid = self._child.pid if self._child else None
            self._child = None
            # NOTE: the leftovers are stopped before any restart: the next engine must find the device free.
            self._stop_leftovers()
            if self._stopping is not None:
                log.info("the service stopped", extra={"service_name": self.name, "exit_code": code})
                return 128 + signal.SIGKILL if killed else 0
            if code in PERMANENT_EXIT_CODES:
                log.critical("the service exited and will not be started again",
                             extra={"service_name": self.name, "exit_code": code,
                                    "reason": PERMANENT_EXIT_CODES[code]})
                return code
            delay = (self.policy.first_delay_s if uptime >= self.policy.stable_after_s or delay == 0
                     else min(delay * 2, self.policy.max_delay_s))
            next_start = time.monotonic() + delay
            log.error("the service exited; starting it again",
                      extra={"service_name": self.name, "pid": pid, "exit_code": code,
                             "uptime_s": round(uptime, 1), "restart_in_s": delay})


def exec_supervisor(name: str, argv: Sequence[str]) -> None:
    """Become ``name``'s supervisor: exec a fresh interpreter that imports only what supervising needs (the CLI
    that calls this imports the whole platform). The pid stays the same, so PID files and callers still hold it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "runtime.supervisor", name, "--", *argv])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m runtime.supervisor NAME -- COMMAND...", file=sys.stderr)
        sys.exit(os.EX_USAGE)
    name, command = args[0], args[2:]
    from pydantic import ValidationError

    from runtime.logs import configure_logging
    from runtime.settings import load_settings

    try:
        # The child reads the same environment: a configuration it would refuse fails here, once, not in a loop.
        settings = load_settings()
    except ValidationError as exc:
        print(f"{name}: the configuration is wrong:\n{exc}", file=sys.stderr)
        sys.exit(os.EX_CONFIG)
    configure_logging(settings.observability, service=f"{name}-supervisor")
    own = settings.supervisor
    policy = RestartPolicy(first_delay_s=own.first_delay_s, max_delay_s=own.max_delay_s,
                           stable_after_s=own.stable_after_s, stop_timeout_s=own.stop_timeout_s)
    sys.exit(Supervisor(name, command, policy).run())


if __name__ == "__main__":
    main()
