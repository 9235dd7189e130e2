"""Adversarial review of 88ef973 (``kns-event-ids``), 61f79fe (phased synthetic engines) and 638faed (GC pauses,
``gc.freeze``). Each test failed on the reviewed code, for the reason its docstring gives.

(``tests/unit/test_transport_review.py`` holds an earlier review's tests, hence this file's name.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from bench.chaos import client as chaos
from bench.loadgen import RequestResult
from bench.relay import _ttft_p99_by_tenth
from producers.gateway import errors
from producers.gateway.deps import authenticate
from producers.gateway.routes import chat as chat_routes
from tests.fakes.tenancy import api_key

REPO = Path(__file__).resolve().parents[2]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


# --- 1. the header's enum is not enforced on non-streaming requests ---------------------------------------------


class _NoAdmission:
    def __init__(self) -> None:
        self.accepted = 0

    def refuse_early(self, key: Any) -> None:
        return None  # no refusal remembered

    async def accept(self, *_: Any, **__: Any) -> Any:
        self.accepted += 1
        return SimpleNamespace(request_id="chatcmpl-x", ticket=None)

    async def complete(self, accepted: Any) -> dict[str, Any]:
        return {"id": accepted.request_id, "object": "chat.completion"}


@pytest.fixture
def gateway() -> Iterator[tuple[TestClient, _NoAdmission]]:
    chat = _NoAdmission()
    app = FastAPI()
    errors.install(app)
    app.include_router(chat_routes.router)
    app.state.ctx = SimpleNamespace(chat=chat, settings=SimpleNamespace(gateway=SimpleNamespace(sse_event_ids=True)))
    app.dependency_overrides[authenticate] = lambda: api_key(tier="plus")
    with TestClient(app) as client:
        yield client, chat


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_kns_event_ids_header_is_refused_before_admission_whether_streaming_or_not(
        gateway: tuple[TestClient, _NoAdmission], stream: bool) -> None:
    """routes/chat.py:158 ``event_ids = body.stream and _event_ids(...)``: the header is only read (and checked)
    for streams, so ``kns-event-ids: AAA`` on a non-streaming request is admitted and answered 200. But
    ``/openapi.json`` declares the header on the whole operation with an enum, and schemathesis' coverage phase
    (tests/e2e/test_openapi_contract.py, ``--checks all``) sends exactly that: ``kns-event-ids`` = ``AAA``, ``2``,
    ``0.5``, ``null``, ``{}`` with its base body, whose ``stream`` is false -> 200 to a schema-violating request,
    a ``negative_data_rejection`` failure. Fix: check the header on every request, before admission."""
    client, chat = gateway
    answer = client.post("/v1/chat/completions", json={**BODY, "stream": stream},
                         headers={"Authorization": "Bearer x", "kns-event-ids": "AAA"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "kns-event-ids"
    assert chat.accepted == 0


# --- 2. the chaos client takes a stream without ids for one that never started -----------------------------------


def _events(request_id: str, ids: bool, start: int = 0) -> bytes:
    """A stream of role + 3 content chunks + finish, from position ``start`` on."""
    bodies = [{"id": request_id, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    bodies += [{"id": request_id, "choices": [{"index": 0, "delta": {"content": t}}]} for t in ("a", "b", "c")]
    bodies += [{"id": request_id, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
    import orjson
    out = b""
    for position, body in enumerate(bodies):
        if position < start:
            continue
        out += (f"id: {request_id}:{position}\n".encode() if ids else b"") + b"data: " + orjson.dumps(body) + b"\n\n"
    return out


def _gateway_without_ids_by_default(request: httpx.Request) -> httpx.Response:
    """A gateway run with ``gateway.sse_event_ids=false``: a new stream breaks after its second content chunk
    (its gateway died); a resume (Last-Event-ID, or GET the whole stream) always has ids."""
    rid = "chatcmpl-r"
    headers = {"x-request-id": rid, "content-type": "text/event-stream"}
    if request.method == "GET":
        return httpx.Response(200, headers=headers, content=_events(rid, True) + b"data: [DONE]\n\n")
    last = request.headers.get("last-event-id")
    if last is not None:
        start = int(last.rpartition(":")[2]) + 1
        return httpx.Response(200, headers=headers, content=_events(rid, True, start) + b"data: [DONE]\n\n")
    ids = request.headers.get("kns-event-ids", "off").strip().lower() in ("on", "true", "1")
    broken = b"\n\n".join(_events(rid, ids).split(b"\n\n")[:3]) + b"\n\n"  # role, "a", "b"
    return httpx.Response(200, headers=headers, content=broken)


async def test_the_chaos_client_resumes_a_stream_without_ids_without_repeating_its_text(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/chaos/client.py:_connect: a broken stream with no ``last_event_id`` is taken for one that had no event
    yet and replayed whole (GET ?stream=true), appended to the text it already has. With the gateway's
    ``sse_event_ids`` off (88ef973), a stream that broke after some content has no id either: its text comes out
    doubled ('ababc') and the chaos audit reports a corrupt stream the gateway never sent. Fix: the chaos client
    relies on ids, so it asks for them (``kns-event-ids: on``) whatever the gateway's default."""
    monkeypatch.setattr(chaos, "RECONNECT_PAUSE_S", 0.0)
    transport = httpx.MockTransport(_gateway_without_ids_by_default)
    clients = [httpx.AsyncClient(transport=transport, base_url=f"http://g{i}/v1") for i in range(2)]
    stream = chaos.Stream(0, "p", 4)
    try:
        await chaos.run_stream(clients, stream, "k", "m", t0=0.0)
    finally:
        for c in clients:
            await c.aclose()
    assert stream.done and stream.text == "abc", stream.text


# --- 3. the gc callback takes the histogram's lock that a scrape may hold ---------------------------------------


def test_a_collection_while_the_pause_histogram_is_being_read_does_not_deadlock() -> None:
    """runtime/gc_pauses.py:_on_gc calls ``GC_PAUSE.labels(...)``, which takes the histogram's (non-reentrant)
    ``threading.Lock``. ``/metrics`` (runtime/metrics.py, on the gateway's event loop) holds that same lock while
    it copies the children (``MetricWrapperBase._multi_samples``: ``with self._lock: self._metrics.copy()``); a
    collection can start on any GC-tracked allocation, that copy included (CPython 3.11 collects synchronously in
    the allocating thread), and then the callback blocks forever on a lock its own thread holds: the event loop,
    hence every stream of the process, stops for good. Rare (the copy mostly reuses a free-listed dict), fatal.
    The test holds the lock and collects, as that allocation would, in a child process (a deadlock there cannot
    hang this one). Fix: resolve the three generations' children once, in ``watch``, and observe on them (a
    child's own value locks are never held across an allocation)."""
    code = textwrap.dedent("""
        import gc
        from runtime import gc_pauses
        from runtime.metrics import GC_PAUSE
        gc_pauses.watch()
        with GC_PAUSE._lock:  # a scrape copying the children
            gc.collect(0)
        print("ok")
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the gc callback deadlocked on the histogram's lock")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# --- 4. kns bench relay's tenths leave the last streams out -------------------------------------------------------


def test_ttft_by_tenth_covers_every_stream() -> None:
    """bench/relay.py:_ttft_p99_by_tenth: tenths of ``len // 10`` streams each, ten of them: the last
    ``len % 10`` streams (the latest started) are in none. 19 streams: tenths of one stream, the last 9 never
    counted; with slow first tokens at the end of the ramp (what the figure is for), they disappear from it.
    Fix: cut at ``len * i // 10``."""
    results = [RequestResult(i, ok=True, started_at=float(i), ttft=0.1) for i in range(10)]
    results += [RequestResult(i, ok=True, started_at=float(i), ttft=5.0) for i in range(10, 19)]
    tenths = _ttft_p99_by_tenth(results)
    assert len(tenths) == 10
    assert tenths[-1] == 5.0, tenths
    assert sum(t == 5.0 for t in tenths) >= 4, tenths  # 9 of 19 streams are slow: about half the tenths
