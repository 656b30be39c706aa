"""What one request or stream may cost the server (docs/reliability.md, Request limits),
on the real app over the fake engine: requests over a limit are 400s naming it, before any
work; pathological grammars are 400s and the server keeps serving; dashboard streams are
capped per tenant; the events stream does not dump every live agent; a caller over its rate
is refused before its body is read."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from server.runtime.limits import Rate
from tests.support.clients import local_client
from tests.support.fake_engine import FakeEngine, FakeServer
from tests.support.tenants import KEYS, as_tenant, keyed_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    with keyed_server(tmp_path_factory.mktemp("request-limits"), kv_tokens=16384) as s:
        yield s


def _as(s: FakeServer, tenant: str, timeout: float = 60) -> httpx.Client:
    return as_tenant(s, tenant, timeout)


def _refused(r: httpx.Response, *words: str) -> None:
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message


def _still_serves(c: httpx.Client) -> None:
    r = c.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_a_quarter_million_stop_sequences_are_a_400(srv) -> None:
    with _as(srv, "alice") as alice:
        stops = [f"s{i}" for i in range(250_000)]
        r = alice.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "n": 16,
                                                "stop": stops})
        _refused(r, "250000", "--max-stop")
        assert r.json()["error"]["param"] == "stop"
        # at the limit: served
        ok = alice.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                 "stop": stops[:16]})
        assert ok.status_code == 200, ok.text
        _still_serves(alice)


def test_long_stop_sequences_are_a_400(srv) -> None:
    with _as(srv, "alice") as alice:
        r = alice.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stop": ["ok", "z" * 5000]})
        _refused(r, "stop[1]", "5000", "--max-stop-chars")


def test_a_chat_of_110000_messages_is_a_400(srv) -> None:
    with _as(srv, "alice") as alice:
        messages = [{"role": "user", "content": "a"}] * 110_000
        r = alice.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        _refused(r, "110000", "--max-messages")
        _still_serves(alice)


def _schema_request(schema: dict) -> dict:
    return {"messages": [{"role": "user", "content": "json please"}], "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}


def test_a_50000_entry_enum_is_a_400(srv) -> None:
    with _as(srv, "alice") as alice:
        r = alice.post("/v1/chat/completions",
                       json=_schema_request({"enum": [f"v{i}" for i in range(50_000)]}))
        _refused(r, "--max-schema-bytes")
        assert r.json()["error"]["param"] == "response_format"
        # small in bytes, but over the count of enum values
        r = alice.post("/v1/chat/completions",
                       json=_schema_request({"enum": list(range(5000))}))
        _refused(r, "enum")


def test_schema_structure_limits(srv) -> None:
    with _as(srv, "alice") as alice:
        wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
        _refused(alice.post("/v1/chat/completions", json=_schema_request(wide)), "properties")
        deep: dict = {"type": "integer"}
        for _ in range(14):
            deep = {"type": "array", "items": deep}
        _refused(alice.post("/v1/chat/completions", json=_schema_request(deep)), "deeper")


def test_a_counted_pattern_is_a_400_and_the_server_keeps_serving(srv) -> None:
    with _as(srv, "alice") as alice, _as(srv, "bob") as bob:
        schema = {"type": "string", "pattern": "^(ab|cd){5000}$"}
        r = alice.post("/v1/chat/completions", json=_schema_request(schema))
        _refused(r, "5000")
        _still_serves(bob)
        _still_serves(alice)


@pytest.fixture(scope="module")
def compiling(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    """Structural limits lifted: only the grammar compiler's budget stands."""
    with FakeServer(tmp_path_factory.mktemp("grammar"), max_pattern_repeat=1_000_000,
                    max_schema_properties=1_000_000, max_schema_enum=1_000_000,
                    max_schema_bytes=4 * 1024 * 1024, grammar_timeout_s=2.0,
                    grammar_warm_up=True) as s:
        yield s


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_is_ready_once_its_grammar_worker_has_loaded_its_compiler(compiling) -> None:
    """The worker's imports (torch, xgrammar) take seconds of CPU: done before the server
    says it is ready, not beside the engine serving its first agents."""
    warming = compiling.app.state.grammar_warm_up
    assert warming.done() and warming.exception() is None
    assert compiling.app.state.grammars._pool is not None  # started, and kept


@pytest.mark.slow
@pytest.mark.timeout(300)  # loading the compiler in each new worker takes 5-25 s here
def test_grammars_over_the_time_budget_or_refused_are_400s(compiling) -> None:
    with local_client(base_url=compiling.url, timeout=300) as c:
        # a schema that compiles: served (the worker's start is not part of the budget)
        r = c.post("/v1/chat/completions", json=_schema_request({"type": "integer"}))
        _compiled(r)
        # compiles for tens of seconds: refused once the budget is spent, worker replaced
        r = c.post("/v1/chat/completions",
                   json=_schema_request({"type": "string", "pattern": "^(ab|cd){5000}$"}))
        _refused(r, "--grammar-timeout")
        _still_serves(c)
        # the compiler's own refusal: that request only
        r = c.post("/v1/chat/completions",
                   json=_schema_request({"type": "string", "pattern": "(unclosed"}))
        _refused(r, "grammar compiler")
        # a new worker compiles the next schema
        r = c.post("/v1/chat/completions", json=_schema_request({"type": "boolean"}))
        _compiled(r)
        # the outcome is cached: the same schema is refused again without compiling
        grammars = compiling.app.state.grammars
        compiles = grammars.compiles
        r = c.post("/v1/chat/completions",
                   json=_schema_request({"type": "string", "pattern": "^(ab|cd){5000}$"}))
        _refused(r, "--grammar-timeout")
        assert grammars.compiles == compiles


def _compiled(r: httpx.Response) -> None:
    """The schema passed the grammar check and reached the engine: served, or (on the fake
    engine, which has no structured output) refused by the engine, not by the compiler."""
    if r.status_code == 400 and "the fake engine has no structured output" in r.text:
        return
    assert r.status_code == 200, r.text


def _grammar_worker_facts() -> tuple[int, str, int]:
    """Run in the grammar worker: its niceness, its OpenMP setting, torch's thread count."""
    import os

    import torch  # loaded there by the compiler (xgrammar)

    return os.getpriority(os.PRIO_PROCESS, 0), os.environ.get("OMP_NUM_THREADS", ""), torch.get_num_threads()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_grammar_worker_runs_at_the_lowest_priority_on_one_thread(compiling) -> None:
    """A compile must not take the engine's CPU: the worker runs at nice 19 (below the
    EngineCore's 10) and its libraries on one thread."""
    from predictors.worker import HELPER_NICE as WORKER_NICE

    with local_client(base_url=compiling.url, timeout=300) as c:
        r = c.post("/v1/chat/completions", json=_schema_request({"type": "number"}))
        _compiled(r)
    pool = compiling.app.state.grammars._pool
    assert pool is not None
    nice, omp, torch_threads = pool.submit(_grammar_worker_facts).result(timeout=120)
    assert WORKER_NICE == 19 and nice == WORKER_NICE
    assert omp == "1" and torch_threads == 1


def _open_dashboard(c: httpx.Client) -> httpx.Response:
    return c.send(c.build_request("GET", "/v1/scheduler/events"), stream=True)


def _first_frame(lines: Iterator[str]) -> dict:
    # `lines` is kept by the caller: closing the iterator would close the stream
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: "):])
    raise AssertionError("the stream ended without a frame")


def test_dashboard_streams_are_capped_per_tenant_and_share_their_frames(srv) -> None:
    with _as(srv, "alice") as alice, _as(srv, "bob") as bob:
        alice.post("/v1/agents", json={"type": "dash", "prompt": "one"})
        streams = [_open_dashboard(alice) for _ in range(8)]
        try:
            assert all(s.status_code == 200 for s in streams)
            lines = [s.iter_lines() for s in streams]
            frames = [_first_frame(x) for x in lines]
            assert all(f.get("reset") for f in frames)
            over = alice.get("/v1/scheduler/events")
            assert over.status_code == 429, over.text
            assert "--max-dashboard-streams" in over.json()["detail"]
            assert int(over.headers["Retry-After"]) >= 1
            # another tenant's streams are counted apart
            other = _open_dashboard(bob)
            assert other.status_code == 200
            other.close()
            # one feed builds alice's frames, whatever the number of her streams
            feeds = srv.app.state.dashboard_streams.feeds
            assert [key for key in feeds if key[0] == "alice"] == [("alice", False)]
        finally:
            streams.pop().close()
        # a closed stream gives its place back
        deadline = time.monotonic() + 10
        while True:
            again = _open_dashboard(alice)
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            again.close()
            time.sleep(0.1)
        assert again.status_code == 200
        again.close()
        for s in streams:
            s.close()


def test_the_events_stream_without_ids_caps_its_first_snapshot(tmp_path) -> None:
    with FakeServer(tmp_path) as s, local_client(base_url=s.url, timeout=60) as c:
        for i in range(1005):
            assert c.post("/v1/agents", json={"type": "many", "prompt": f"p{i}"}).status_code == 201
        seen: list[str] = []
        more = None
        with c.stream("GET", "/v1/agents/events") as r:
            event = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    event = line[len("event: "):]
                elif line.startswith("data: "):
                    data = json.loads(line[len("data: "):])
                    if event == "agent":
                        seen.append(data["id"])
                    elif event == "more":
                        more = data
                        break
        assert len(seen) == 1000
        assert more is not None and more["more"] == 5 and more["shown"] == 1000
        # the cursor continues the agent list where the snapshot stopped
        page = c.get("/v1/agents", params={"cursor": more["cursor"]}).json()
        rest = [a["id"] for a in page["agents"]]
        assert len(rest) == 5 and not set(rest) & set(seen)


@pytest.mark.slow
def test_the_scheduler_snapshot_is_bounded(tmp_path) -> None:
    engine = FakeEngine(kv_capacity_tokens=1024, max_model_len=256, step_s=0.05)
    with FakeServer(tmp_path, engine=engine) as s, local_client(base_url=s.url, timeout=60) as c:
        ids = [c.post("/v1/agents", json={"type": "q", "prompt": f"p{i}"}).json()["id"]
               for i in range(80)]
        c.post("/v1/admin/pause")
        import threading

        def send(agent_id: str) -> None:
            with local_client(base_url=s.url, timeout=60) as own:
                own.post("/v1/completions", headers={"X-Justitia-Agent": agent_id},
                         json={"prompt": "x", "max_tokens": 2})

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in ids]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        snap = c.get("/v1/scheduler").json()
        while snap.get("queued_agents", 0) < 80 and time.monotonic() < deadline:
            time.sleep(0.1)
            snap = c.get("/v1/scheduler").json()
        assert snap["queued_agents"] == 80
        assert len(snap["queue"]) == 50
        c.post("/v1/admin/resume")
        for t in threads:
            t.join(30)


def _raw_post(url: str, path: str, headers: dict[str, str], body: bytes = b"",
              timeout_s: float = 10) -> str:
    """Send a request's head (and `body`, maybe less than its Content-Length) and return
    the status line of the answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode() + body)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            return "no answer"
    return data.split(b"\r\n", 1)[0].decode()


def test_an_over_long_content_length_is_a_413_without_reading_the_body(srv) -> None:
    status = _raw_post(srv.url, "/v1/agents", {
        "Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json",
        "Content-Length": str(1 << 30)})
    assert " 413 " in status, status


def _answer_then_close(url: str, path: str, headers: dict[str, str], timeout_s: float = 10) -> bytes:
    """Send a request's head without its body and read until the server closes the
    connection; b"" when it keeps the connection open, waiting for the body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode())
        data = b""
        try:
            while chunk := sock.recv(4096):
                data += chunk
        except TimeoutError:
            return b""
    return data


def test_a_body_refused_unread_closes_its_connection(srv) -> None:
    # The server would otherwise go on receiving the megabytes the client still sends.
    answer = _answer_then_close(srv.url, "/v1/agents", {
        "Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json",
        "Content-Length": str(1 << 30)}, timeout_s=5)
    assert b" 413 " in answer.split(b"\r\n", 1)[0], answer[:200]
    assert b"connection: close" in answer.lower()


def test_the_rate_limit_comes_before_the_body_is_read(tmp_path) -> None:
    with FakeServer(tmp_path, api_keys={v: k for k, v in KEYS.items()},
                    rate_limit=Rate(0.01, 1.0)) as s:
        with _as(s, "alice") as alice:
            assert alice.post("/v1/agents", json={"type": "t", "prompt": "x"}).status_code == 201
        for path in ("/v1/agents", "/v1/completions", "/v1/chat/completions"):
            # a 3 MB body announced, none of it sent: over the rate, refused at once
            status = _raw_post(s.url, path, {
                "Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json",
                "Content-Length": str(3 << 20)}, timeout_s=5)
            assert " 429 " in status, (path, status)
        refused = _answer_then_close(s.url, "/v1/agents", {
            "Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json",
            "Content-Length": str(3 << 20)}, timeout_s=5)
        assert b" 429 " in refused.split(b"\r\n", 1)[0] and b"connection: close" in refused.lower()
        # another tenant is not affected
        with _as(s, "bob") as bob:
            assert bob.post("/v1/agents", json={"type": "t", "prompt": "x"}).status_code == 201


def test_serve_takes_the_request_limit_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from justitia_cli import build_parser
    from server.cli import serving

    parser = build_parser()
    args = parser.parse_args(["serve", "--max-stop", "4", "--max-stop-chars", "64",
                              "--max-messages", "100", "--max-schema-bytes", "16K",
                              "--grammar-timeout", "0.5", "--max-dashboard-streams", "2"])
    seen = {}
    monkeypatch.setattr(serving, "serve", lambda config: seen.setdefault("config", config) and 0)
    serving.run_serve(args)
    config = seen["config"]
    assert (config.max_stop, config.max_stop_chars, config.max_messages, config.max_schema_bytes,
            config.grammar_timeout_s, config.max_dashboard_streams) == (4, 64, 100, 16 << 10, 0.5, 2)
    defaults = parser.parse_args(["serve"])
    assert (defaults.max_stop, defaults.max_stop_chars, defaults.max_messages,
            defaults.max_schema_bytes, defaults.grammar_timeout,
            defaults.max_dashboard_streams) == (16, 256, 2048, 64 << 10, 2.0, 8)
    for bad in (["--max-stop", "0"], ["--max-schema-bytes", "10"], ["--max-messages", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])


def test_a_long_prompt_whose_head_cannot_fit_is_refused_before_the_rest_is_tokenized(srv) -> None:
    """262k characters of CJK text are ~262k tokens: only the head is tokenized."""
    engine = srv.engine
    calls: list[int] = []
    tokenize = engine.tokenize

    def counting(text: str) -> list[int]:
        calls.append(len(text))
        return tokenize(text)

    engine.tokenize = counting  # type: ignore[method-assign]
    try:
        with _as(srv, "alice") as alice:
            r = alice.post("/v1/completions", json={"prompt": "漢" * 120_000, "max_tokens": 2})
        _refused(r, "cannot fit")
        assert calls and max(calls) < 120_000
    finally:
        del engine.tokenize
