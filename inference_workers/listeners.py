"""Who can still receive a stream: the client connections attached to it, and what each one received.

A stream starts attached to one connection, its accepting gateway's (``ORIGIN_ATTACHMENT``). Every other fact comes
from the control topic: a gateway that resumes the stream attaches a connection of its own (ATTACH); a connection
whose client went away detaches, saying how many completion tokens its client received (DETACH) and how long to
keep generating for a client to come back (the resume window of its tier); a cancel names the connection it ends,
if any. The worker's presence check adds what the log cannot say: whether each attached connection's gateway
process is still alive (a dead gateway detaches nothing), and how many tokens were out when it last was.

While no connection is attached, the worker suspends the generation (``intake.py``): nothing more is generated for
nobody, only what was in flight when the worker learned of it (a drop's DETACH takes milliseconds; a dead gateway
is found within its liveness TTL plus a presence check).

The billing rule of a generation that stops before its end (cancelled, halted, or unattended past its window),
whoever stops it and from whichever gateway (:meth:`Listeners.received_cap`):

* while a connection is attached to a live gateway: every token emitted (the relay delivers every delta before the
  final: that connection receives them all);
* else the most any connection bills: one whose client dropped it (or whose gateway ended it) every token emitted,
  which is what the log holds for any client of the stream to read for the resume TTL (beyond what that client
  read: only what was in flight when it dropped), and at least what it reported receiving (a stalled
  predecessor's tokens may have reached it); one whose gateway died, what was emitted while that gateway was last
  seen alive (a crash of ours is not the client's to pay: the tokens emitted between the crash and its discovery,
  at most the gateway's liveness TTL plus a presence check, are not billed and stay readable).

A finished answer is billed whole. So no cancel, from any gateway, lowers the bill below what some gateway delivered
to a client of the stream, and a client that drops its connection cannot read later what it is not billed for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import ORIGIN_ATTACHMENT, ControlAction, ControlEvent


@dataclass
class Connection:
    gateway_id: str
    detached: bool = False
    #: completion tokens its client received, as its gateway reported when the connection ended
    reported: int | None = None
    #: whether its gateway process was alive at the last presence check (a dead one reports nothing)
    gateway_alive: bool = True
    #: tokens emitted when its gateway was last seen alive while it was attached
    seen_tokens: int = 0

    @property
    def live(self) -> bool:
        return not self.detached and self.gateway_alive

    def billed(self, emitted: int) -> int:
        """What a stop bills for this connection: everything emitted once it ended (its client dropped, or its gateway
        ended it: the log holds it for any client of the stream, and what was in flight then is milliseconds' worth),
        at least what it reported; for one whose gateway died, what was emitted while that gateway was last seen
        alive (a crash of ours is not the client's to pay)."""
        if self.detached:
            return max(emitted, self.reported or 0)
        return self.seen_tokens


@dataclass
class Listeners:
    """One stream's client connections."""

    connections: dict[str, Connection] = field(default_factory=dict)
    #: how long to wait for a client once none is attached: the window of the last connection that detached
    #: (None: the worker's own, for a connection whose gateway died)
    window_s: float | None = None
    #: since when no connection has been attached (the intake's clock); None while one is
    unattended_since: float | None = None

    @classmethod
    def of(cls, origin_gateway: str) -> Listeners:
        return cls({ORIGIN_ATTACHMENT: Connection(origin_gateway)})

    def apply(self, event: ControlEvent) -> None:
        """A control event about this stream (in log order for each connection; connections in any order)."""
        name = event.attachment
        if name is None and event.action is ControlAction.CANCEL and event.delivered_tokens is not None:
            # A gateway of before v3 ended its connection: the accepting one's, or a resume of its own
            origin = self.connections.get(ORIGIN_ATTACHMENT)
            # A v2 gateway said its instance id; the origin is named instance/incarnation (of one process of a fleet)
            ours = origin is not None and event.issued_by in (origin.gateway_id, origin.gateway_id.rsplit("/", 1)[0])
            name = ORIGIN_ATTACHMENT if ours else f"@{event.issued_by}"
        if name is None or event.action not in (ControlAction.ATTACH, ControlAction.DETACH, ControlAction.CANCEL):
            return
        connection = self.connections.setdefault(name, Connection(event.issued_by))
        if event.action is ControlAction.ATTACH:
            self.window_s = None
            return
        connection.detached = True
        if event.delivered_tokens is not None:
            connection.reported = max(connection.reported or 0, event.delivered_tokens)
        if event.action is ControlAction.DETACH and event.window_s is not None:
            self.window_s = event.window_s

    def attached_gateways(self) -> set[str]:
        """The gateway processes of the connections still attached (to be checked alive)."""
        return {c.gateway_id for c in self.connections.values() if not c.detached}

    def seen(self, alive: dict[str, bool], tokens: int) -> None:
        """A presence check's answer: which gateways live; ``tokens`` were out at the time."""
        for connection in self.connections.values():
            if connection.detached:
                continue
            connection.gateway_alive = alive.get(connection.gateway_id, connection.gateway_alive)
            if connection.gateway_alive:
                connection.seen_tokens = max(connection.seen_tokens, tokens)

    def took_over(self, tokens: int) -> None:
        """This worker continues a stream an earlier attempt emitted ``tokens`` of: they were relayed by some
        gateway, or can be resumed; a connection that reported what it received keeps its report."""
        for connection in self.connections.values():
            connection.seen_tokens = max(connection.seen_tokens, tokens)

    @property
    def live(self) -> bool:
        return any(c.live for c in self.connections.values())

    def note(self, now: float) -> None:
        """Start (or stop) the unattended clock as the connections now stand."""
        if self.live:
            self.unattended_since = None
        elif self.unattended_since is None:
            self.unattended_since = now

    def expired(self, now: float, default_window_s: float) -> bool:
        """Nobody has been attached for the window: the generation is to be cancelled."""
        window = self.window_s if self.window_s is not None else default_window_s
        return self.unattended_since is not None and now - self.unattended_since >= window

    def received_cap(self, emitted: int) -> int | None:
        """What a generation stopped now, having emitted ``emitted`` completion tokens, is billed (the module's rule):
        None while a connection is attached (everything emitted reaches it), else the most any connection bills."""
        if self.live:
            return None
        return max((c.billed(emitted) for c in self.connections.values()), default=0)
