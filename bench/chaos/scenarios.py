"""The chaos scenarios: one fault each, injected while the load runs. A Protocol, one class per scenario, a
registry (as the gateway policies of SGLang are laid out)."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from typing import Protocol

from bench.chaos.audit import Expectation
from bench.chaos.client import Load
from bench.chaos.environment import ChaosEnv, Knobs
from ops.stack.process import stop as stop_pid


class Scenario(Protocol):
    name: str
    summary: str
    #: workers and gateways running when the load starts (the load spreads its streams over the gateways)
    workers: int
    gateways: int
    #: each stream is a turn of a conversation of its own, and the conversation writer runs (and is audited)
    conversations: bool
    #: what the run must show (the audit's goals beyond nothing lost, duplicated, spliced or misbilled)
    expectation: Expectation

    def knobs(self, knobs: Knobs) -> Knobs:
        """The services' settings this scenario needs (shorter deadlines, a smaller engine)."""
        ...

    async def before_load(self, env: ChaosEnv, say: Say) -> None:
        """What must be broken before the first request is sent."""
        ...

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        """Called as the load starts; returns once the fault is over (the load goes on to its end)."""
        ...


class Say(Protocol):
    def __call__(self, message: str) -> None: ...


async def _until(load: Load, t: float) -> None:
    await asyncio.sleep(max(0.0, t - load.now()))


async def _streams_done(load: Load, at_least: int, poll_s: float = 0.05) -> int:
    """Waits until at least ``at_least`` streams of the load are done (the load has no event to wait on)."""
    while True:
        done = sum(s.done for s in load.streams)
        if done >= at_least:
            return done
        await asyncio.sleep(poll_s)


async def _mid_stream(load: Load, poll_s: float = 0.05) -> None:
    """Waits until some stream of the load has received text and is not done yet."""
    while True:  # the load has no event to wait on
        if any(s.chunk_times and not s.done for s in load.streams):
            return
        await asyncio.sleep(poll_s)


@dataclass
class Base:
    name: str = ""
    summary: str = ""
    workers: int = 2
    gateways: int = 1
    conversations: bool = False
    fault_at_s: float = 1.5
    expectation: Expectation = field(default_factory=Expectation)

    def knobs(self, knobs: Knobs) -> Knobs:
        return knobs

    async def before_load(self, env: ChaosEnv, say: Say) -> None:
        return None


@dataclass
class KillWorker(Base):
    name: str = "kill-worker"
    summary: str = "SIGKILL one worker process mid-generation; its supervisor starts it again"
    expectation: Expectation = field(default_factory=lambda: Expectation(min_taken_over=1))

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        # Not at a fixed moment: that found worker 0 between requests once on CI, and on a faster machine after the
        # last of them (nothing to take over). The first moment one of its requests has a quarter of its tokens out.
        running = await env.mid_generation(env.workers[0], at_least=0.25)
        load.fault_begins()
        pid = env.kill_service(env.workers[0])
        say(f"killed worker 0 (pid {pid}) at {load.now():.1f} s, {len(running)} requests in flight")
        await env.workers[0].wait(300)
        say(f"worker 0 healthy again at {load.now():.1f} s")


@dataclass
class RollWorkers(Base):
    name: str = "roll-workers"
    summary: str = "SIGTERM each worker in turn (a rolling deploy): drain, leave, start again"

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        load.fault_begins()
        for i, worker in enumerate(env.workers):
            await asyncio.to_thread(worker.stop)
            say(f"worker {i} stopped at {load.now():.1f} s")
            worker.start()
            await worker.wait(300)
            say(f"worker {i} back at {load.now():.1f} s")


@dataclass
class AddWorker(Base):
    name: str = "add-worker"
    summary: str = "a second worker joins while one worker has a backlog"
    workers: int = 1

    def knobs(self, knobs: Knobs) -> Knobs:
        return Knobs(**{**knobs.__dict__, "max_seqs": 6})  # a small engine: a backlog builds up

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        load.fault_begins()
        worker = env.add_worker()
        await worker.wait(300)
        say(f"worker {len(env.workers) - 1} joined at {load.now():.1f} s")


@dataclass
class RestartBroker(Base):
    name: str = "restart-broker"
    summary: str = "stop the Kafka broker and start it again (the whole local stack's broker)"

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _restart_infra(env, load, say, "kafka", self.fault_at_s, down_s=2.0)


@dataclass
class StopCassandra(Base):
    name: str = "stop-cassandra"
    summary: str = "stop Cassandra for a while (the local stack's), then start it again"
    down_s: float = 60.0

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _restart_infra(env, load, say, "cassandra", self.fault_at_s, down_s=self.down_s)


async def _restart_infra(env: ChaosEnv, load: Load, say: Say, name: str, at: float, *, down_s: float) -> None:
    await _until(load, at)
    manager = env.stack()
    service = manager.service(name)
    load.fault_begins()
    await asyncio.to_thread(stop_pid, manager.pid_file(service), timeout_s=60)
    say(f"{name} stopped at {load.now():.1f} s")
    await asyncio.sleep(down_s)
    await manager.up(app=False)
    say(f"{name} healthy again at {load.now():.1f} s")


@dataclass
class RestartRedis(Base):
    name: str = "restart-redis"
    summary: str = "restart Redis without persistence: every claim, lease and liveness key is lost"
    # Refused at the door while Redis is down (the free tier's rule; the chaos key is enterprise, so rarely), never
    # once accepted
    expectation: Expectation = field(default_factory=lambda: Expectation(
        allowed_failures=frozenset({"refused 503 service_unavailable"}), min_completed_share=0.5))

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        load.fault_begins()
        await env.restart_redis()
        say(f"Redis restarted empty at {load.now():.1f} s")


@dataclass
class FinalizeCrash(Base):
    name: str = "finalize-crash"
    summary: str = "a worker dies after writing finals in a transaction, before committing it"
    # The fault fires at the first commit, a moment the scenario does not see: its requests taken over show it hit
    expectation: Expectation = field(default_factory=lambda: Expectation(min_hit=0, min_taken_over=1))

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        env.arm("finalize.before_commit", "kill")
        say("armed: the first worker to finalize dies before its commit")
        await _until(load, self.fault_at_s)


@dataclass
class CommitTimeout(Base):
    name: str = "commit-timeout"
    summary: str = ("a worker stalls inside a commit past its transaction timeout, not its session timeout: the "
                    "coordinator aborts the transaction and fences the producer, no other worker owns the partitions")
    stall_s: float = 3.5
    transaction_timeout_ms: int = 1000
    expectation: Expectation = field(default_factory=lambda: Expectation(min_hit=0, min_taken_over=1))

    def knobs(self, knobs: Knobs) -> Knobs:
        extra = {**knobs.extra, "KNS_KAFKA__TRANSACTION_TIMEOUT_MS": str(self.transaction_timeout_ms)}
        # No liveness lease: its peer would evict the stalled worker after 1 s, and the scenario would be an
        # expulsion (kill-worker's) instead of a member fenced while the group still assigns it its partitions.
        return Knobs(**{**knobs.__dict__, "extra": extra, "liveness_ttl_s": 0.0})

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        env.arm("finalize.before_commit", f"sleep {self.stall_s}")
        say(f"armed: the first commit stalls the worker for {self.stall_s:g} s inside its transaction "
            f"(timeout {self.transaction_timeout_ms} ms, session timeout {env.knobs.session_timeout_ms} ms)")
        await _until(load, self.fault_at_s)


@dataclass
class StallWorker(Base):
    name: str = "stall-worker"
    summary: str = ("SIGSTOP a worker past its session timeout (a VM freeze, a swap storm), then SIGCONT: its peer "
                    "takes its partitions over while it sleeps; woken, it finds itself fenced and expelled")
    stall_s: float = 10.0
    expectation: Expectation = field(default_factory=lambda: Expectation(min_taken_over=1))

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        await _stall(env.service_pid(env.workers[0]), self.stall_s, "worker 0", load, say)


@dataclass
class StallGateway(Base):
    name: str = "stall-gateway"
    summary: str = ("SIGSTOP one of two gateways past its reply lease (a VM freeze), then SIGCONT: its streams wait, "
                    "nothing of theirs is cancelled, lost or billed twice")
    gateways: int = 2
    stall_s: float = 20.0

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        await _stall(env.service_pid(env.gateways[0]), self.stall_s, "gateway 0", load, say)


async def _stall(pid: int, seconds: float, who: str, load: Load, say: Say) -> None:
    load.fault_begins()
    os.kill(pid, signal.SIGSTOP)
    say(f"{who} (pid {pid}) stopped at {load.now():.1f} s")
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    say(f"{who} continued at {load.now():.1f} s")


@dataclass
class TimeoutStorm(Base):
    name: str = "timeout-storm"
    summary: str = "every worker stopped: requests time out at the gateway; workers come back"
    workers: int = 1
    fault_at_s: float = 0.0
    outage_s: float = 8.0
    deadlines: tuple[float, float] = field(default=(3.0, 2.0))
    after: int = 8  # NOTE: the expectation's min_completed
    # The gateway gives up (timeout) or a worker back in time refuses a request past its deadline: clear either
    # way, and nothing generated for those clients. The streams sent once the workers are back complete.
    expectation: Expectation = field(default_factory=lambda: Expectation(
        allowed_failures=frozenset({"stream timeout", "stream queue_deadline_exceeded"}), must_fail=True,
        min_hit=0, min_completed_share=0.0, min_completed=8))

    def knobs(self, knobs: Knobs) -> Knobs:
        return Knobs(**{**knobs.__dict__, "queue_deadline_s": self.deadlines[0],
                        "first_token_grace_s": self.deadlines[1]})

    async def before_load(self, env: ChaosEnv, say: Say) -> None:
        # Before the load, not during it: a stopping worker drains what it has, and on a fast machine that was
        # every request of the load (one run in six timed nothing out).
        for worker in env.workers:
            await asyncio.to_thread(worker.stop)
        say("workers stopped before the load")

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await asyncio.sleep(self.outage_s)
        for worker in env.workers:
            worker.start()
        await asyncio.gather(*(w.wait(300) for w in env.workers))
        say(f"workers back at {load.now():.1f} s; {self.after} more requests")
        await load.more(self.after)  # served normally: nothing queued for nobody stands in their way


@dataclass
class KillGateway(Base):
    name: str = "kill-gateway"
    summary: str = ("SIGKILL one of two gateways mid-stream; its clients resume on the other with Last-Event-ID; "
                    "its supervisor starts it again")
    gateways: int = 2
    expectation: Expectation = field(default_factory=lambda: Expectation(min_resumed=1))

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        load.fault_begins()
        pid = env.kill_service(env.gateways[0])
        say(f"killed gateway 0 (pid {pid}) at {load.now():.1f} s")
        await env.gateways[0].wait(300)
        say(f"gateway 0 healthy again at {load.now():.1f} s")


@dataclass
class RollGateways(Base):
    name: str = "roll-gateways"
    summary: str = ("SIGTERM each of two gateways in turn (a rolling deploy): open streams are handed over and "
                    "resumed on the other gateway")
    gateways: int = 2
    expectation: Expectation = field(default_factory=lambda: Expectation(min_resumed=1))

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        await _until(load, self.fault_at_s)
        load.fault_begins()
        for i, gateway in enumerate(env.gateways):
            await asyncio.to_thread(gateway.stop)
            say(f"gateway {i} stopped at {load.now():.1f} s")
            gateway.start()
            await gateway.wait(300)
            say(f"gateway {i} back at {load.now():.1f} s")


@dataclass
class KillWriter(Base):
    name: str = "kill-writer"
    summary: str = ("SIGKILL the conversation writer (the store processor) while turns of conversations finish; "
                    "its supervisor starts it again: every answered turn appended once")
    conversations: bool = True
    turns_before: int = 6

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        assert env.writer is not None
        await _until(load, self.fault_at_s)
        # Mid-work: some turns written (their offsets committed or not: a redelivery must not add copies), and some
        # generating, whose appends then wait for the writer's return.
        done = await _streams_done(load, self.turns_before)
        await _mid_stream(load)
        load.fault_begins()
        pid = env.kill_service(env.writer)
        say(f"killed the conversation writer (pid {pid}) at {load.now():.1f} s, {done} turns done")
        await env.writer.wait(300)
        say(f"the writer healthy again at {load.now():.1f} s")


@dataclass
class DropClients(Base):
    name: str = "drop-clients"
    summary: str = ("every client drops its own connection mid-stream (a phone losing its network); half come back "
                    "within the resume window on the other gateway, half never do")
    gateways: int = 2
    window_s: float = 1.0
    drop_after: int = 5
    back_after_s: float = 0.3
    # The returners complete exactly; the others are cancelled when the window ends, billed what they received;
    # what the worker generated meanwhile is held, not in the log (a token or two in flight when the drop was told)
    expectation: Expectation = field(default_factory=lambda: Expectation(
        allowed_failures=frozenset({"abandoned"}), min_completed_share=0.5, min_resumed=1,
        max_generated_for_nobody=16))

    def knobs(self, knobs: Knobs) -> Knobs:
        # 10 tokens a second: the window (1 s, plus a presence check) ends long before an abandoned stream would
        extra = {**knobs.extra, "KNS_GATEWAY__RESUME_WINDOW_S": str(self.window_s)}
        return Knobs(**{**knobs.__dict__, "tokens_per_s": 10.0, "extra": extra})

    async def inject(self, env: ChaosEnv, load: Load, say: Say) -> None:
        # Before the load's first await: every stream knows its plan when it starts
        for stream in load.streams:
            stream.drop_after = self.drop_after
            stream.back_after_s = self.back_after_s if stream.index % 2 == 0 else None
        while True:  # the load has no event to wait on
            drops = [s.dropped_at for s in load.streams if s.dropped_at is not None]
            if drops:
                load.fault_at = min(drops)
                break
            await asyncio.sleep(0.05)
        say(f"first client dropped its connection at {load.now():.1f} s; window {self.window_s:g} s")


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    KillWorker(), RollWorkers(), AddWorker(), RestartBroker(), StopCassandra(), RestartRedis(), FinalizeCrash(),
    CommitTimeout(), StallWorker(), StallGateway(), TimeoutStorm(), KillGateway(), RollGateways(), KillWriter(),
    DropClients(),
)}
