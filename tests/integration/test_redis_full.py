"""A Redis at its ``maxmemory`` (issue 37 H2): the stack runs it with ``noeviction`` (``ops/stack/services.py``), so a
full Redis refuses writes instead of evicting rate-limit windows, leases and stream records; the gateway answers a
refused write it cannot do without as it answers Redis down, a 503 in OpenAI's shape (never a 500), serves what it
can do without (a chat stream whose record is not written is served, not resumable elsewhere), and nothing held in
Redis is lost.

Redis's own rule decides what a full Redis still runs: a Lua script that has written once may go on writing (the
rate limiter's admission script sweeps first), so admission keeps working, exactly, a little past the bound; a plain
write (a stream record, a lease renewal, a read-your-writes note) is refused.

A gateway of its own (real Kafka and Cassandra, no worker: nothing gets that far) against a redis-server of its own,
started with the stack's own command line, filled to its bound once the gateway is up.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis
from redis.exceptions import OutOfMemoryError

from ops.stack.services import REDIS_MAXMEMORY_POLICY, RedisService
from runtime.settings import Settings
from tests.conftest import GATEWAY_PORT, SESSION, Caller
from tests.helpers import ServiceProcess, wait_until

REDIS_PORT = GATEWAY_PORT + 31
FULL_GATEWAY_PORT = GATEWAY_PORT + 30
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture()
def full_redis(stack: Settings, tmp_path: Path) -> Iterator[Redis]:
    """A redis-server started as the stack starts its own (same flags), on a port and in a folder of its own."""
    own = stack.model_copy(update={"redis": stack.redis.model_copy(update={"url": f"redis://127.0.0.1:{REDIS_PORT}/0"}),
                                   "stack": stack.stack.model_copy(update={"root": tmp_path})})
    service = RedisService(own)
    service.prepare()
    assert shutil.which("redis-server"), "redis-server is not installed"
    proc = subprocess.Popen(service.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = Redis(host="127.0.0.1", port=REDIS_PORT, decode_responses=True)
    try:
        wait_until(lambda: asyncio.run(service.healthy()), "the private redis-server answers PING", timeout_s=30)
        yield client
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)


@pytest.fixture()
def gateway_on_full_redis(full_redis: Redis, service_env: dict[str, str]) -> Iterator[str]:
    env = {**service_env, "KNS_REDIS__URL": f"redis://127.0.0.1:{REDIS_PORT}/0",
           "KNS_GATEWAY__PORT": str(FULL_GATEWAY_PORT), "KNS_GATEWAY__INSTANCE_ID": f"test-gateway-full-{SESSION}"}
    proc = ServiceProcess("gateway-full-redis", "gateway", env, f"http://127.0.0.1:{FULL_GATEWAY_PORT}/health")
    proc.start()
    try:
        proc.wait_healthy(120)
        yield f"http://127.0.0.1:{FULL_GATEWAY_PORT}/v1"
    finally:
        proc.stop()


def lasting(redis: Redis) -> set[str]:
    """The keys Redis holds that no TTL ends within the test (a lease the full Redis refuses to renew may lapse)."""
    return {k for k in redis.scan_iter(count=1000) if redis.ttl(k) == -1 or redis.ttl(k) > 60}


def fill(redis: Redis) -> None:
    """Redis at its bound: ``maxmemory`` just above what it holds, then written until it refuses even a small write
    (a large one is refused first: its own bytes count)."""
    used = int(redis.info("memory")["used_memory"])
    redis.config_set("maxmemory", used + 2 * 1024 * 1024)
    for size in (64 * 1024, 1024, 16):
        with pytest.raises(OutOfMemoryError):
            for i in range(1_000_000):
                redis.set(f"filler:{size}:{i}", "x" * size)


@pytest.mark.timeout(240)
def test_a_full_redis_evicts_nothing_and_a_write_the_gateway_needs_is_answered_503(
        full_redis: Redis, gateway_on_full_redis: str, make_caller: Callable[..., Caller]) -> None:
    assert full_redis.config_get("maxmemory-policy")["maxmemory-policy"] == REDIS_MAXMEMORY_POLICY == "noeviction"
    caller = make_caller(org=f"org-redis-full-{SESSION}", tier="free", limits=None)
    headers = {"Authorization": f"Bearer {caller.secret}"}
    with httpx.Client(base_url=gateway_on_full_redis, headers=headers, timeout=30) as http:
        # State of the key's own in Redis before it fills: a list read takes from the key's read bucket.
        assert http.get("/conversations").status_code == 200
        fill(full_redis)
        held = lasting(full_redis)
        assert any("filler:" not in k for k in held) and any("filler:" in k for k in held)
        # Reads still work on a full Redis: the key is authenticated and its suspension list read.
        assert http.get("/models").status_code == 200
        # A background response's stream record is its only handle while it runs: without it, a 503.
        answer = http.post("/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4,
                                               "background": True})
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert (error["type"], error["code"]) == ("server_error", "service_unavailable"), error
        # A chat stream goes on without its record (it cannot be resumed on another gateway meanwhile).
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with http.stream("POST", "/chat/completions", json=chat) as stream:
            assert stream.status_code == 200
    assert int(full_redis.info("stats")["evicted_keys"]) == 0
    assert held <= set(full_redis.scan_iter(count=1000))  # every key it held is still there
