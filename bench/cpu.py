"""CPU seconds spent by processes (and their children) between two moments: where a run's time goes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from runtime.cpu_priority import autogroup_nice, thread_nice_levels

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[str, int, float] | None:
    """(name, parent pid, user+system seconds) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    name = raw[raw.index("(") + 1: raw.rindex(")")]
    fields = raw.rsplit(")", 1)[1].split()
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def tree(root: int) -> dict[int, tuple[str, float]]:
    """pid → (name, CPU seconds so far) for ``root`` and all its descendants."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            table[int(entry.name)] = stat
    wanted, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (_, ppid, _) in table.items():
            if ppid == parent and pid not in wanted:
                wanted.add(pid)
                frontier.append(pid)
    return {pid: (table[pid][0], table[pid][2]) for pid in wanted if pid in table}


class CpuMeter:
    """Snapshot named process trees, then report each tree's (and each process name's) CPU seconds since."""

    def __init__(self, roots: dict[str, int], alone: frozenset[str] = frozenset()) -> None:
        """``alone``: labels measured without their descendants (a process whose children are measured apart)."""
        self._roots = roots
        self._alone = alone
        self._before = {label: self._snapshot(label, pid) for label, pid in roots.items()}

    def _snapshot(self, label: str, pid: int) -> dict[int, tuple[str, float]]:
        snapshot = tree(pid)
        return {pid: snapshot[pid]} if label in self._alone and pid in snapshot else snapshot

    def since(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for label, pid in self._roots.items():
            before = self._before[label]
            for child, (name, seconds) in self._snapshot(label, pid).items():
                used = seconds - before.get(child, (name, 0.0))[1]
                key = f"{label}:{name}" if child != pid else label
                out[key] = round(out.get(key, 0.0) + used, 3)
        return out


def nice_levels(roots: dict[str, int]) -> dict[str, list[int]]:
    """The nice levels the threads of each named process tree run at, per process (``label:name``, as
    :class:`CpuMeter` names them): which side's processes yielded the CPU to the engine's."""
    out: dict[str, set[int]] = {}
    for label, root in roots.items():
        for pid, (name, _) in tree(root).items():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                out.setdefault(label if pid == root else f"{label}:{name}", set()).update(
                    thread_nice_levels(pid).values())
        if (session := autogroup_nice(root)) is not None:  # what the scheduler weighs first (runtime/cpu_priority)
            out[f"{label} (autogroup)"] = {session}
    return {key: sorted(levels) for key, levels in out.items()}
