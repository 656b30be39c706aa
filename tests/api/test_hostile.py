"""A hostile tenant, on the real app over the fake engine: what one tenant does
must not move another tenant's promises."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.fake_engine import FakeEngine, FakeServer
from tests.support.tenants import KEYS, as_tenant, keyed_server


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    with keyed_server(tmp_path_factory.mktemp("hostile"), kv_tokens=8192) as srv:
        yield srv


_as = as_tenant


def _run_agent(c: httpx.Client, agent_type: str, prompt: str, tokens: int) -> dict:
    rec = c.post("/v1/agents", json={"type": agent_type, "prompt": prompt}).json()
    r = c.post("/v1/completions", headers={"X-Justitia-Agent": rec["id"]},
               json={"prompt": prompt, "max_tokens": tokens, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return c.post(f"/v1/agents/{rec['id']}/finish").json()


def test_one_tenants_agents_do_not_move_another_tenants_cost_estimates(two_tenants) -> None:
    """alice finishing large agents of a type bob uses multiplied bob's predicted cost for
    the same prompt (and so his fair finish and deadline) by 1,953."""
    with _as(two_tenants, "alice") as alice, _as(two_tenants, "bob") as bob:
        prompt = "look up the capital"
        before = bob.post("/v1/agents", json={"type": "bob_type", "prompt": prompt}).json()
        for _ in range(10):
            _run_agent(alice, "bob_type", prompt * 20, 600)
        after = bob.post("/v1/agents", json={"type": "bob_type", "prompt": prompt}).json()
        assert after["predicted_cost"] == pytest.approx(before["predicted_cost"])
        assert after["cost_source"] == "cold_start"
        # alice's own estimate did learn from her agents.
        hers = alice.post("/v1/agents", json={"type": "bob_type", "prompt": prompt}).json()
        assert hers["predicted_cost"] != pytest.approx(before["predicted_cost"])


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("depth", [40, 600, 900, 995, 5000])
def test_deeply_nested_json_is_a_400_not_a_500(two_tenants, depth) -> None:
    with _as(two_tenants, "alice") as alice:
        agent = ('{"type": "deep", "prompt": "x", "metadata": {"k": ' + _nested(depth) + "}}")
        r = alice.post("/v1/agents", content=agent, headers={"content-type": "application/json"})
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
        # Past ~990 levels Python's JSON parser itself gives up: still a 400.
        assert "nested deeper than 32" in r.text or "parsing the body" in r.text
        completion = ('{"prompt": "x", "max_tokens": 1, "metadata": {"k": ' + _nested(depth)
                      + "}}")
        r = alice.post("/v1/completions", content=completion,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, (depth, r.status_code, r.text[:200])
    # Shallow metadata still works.
    with _as(two_tenants, "bob") as bob:
        ok = bob.post("/v1/agents", json={"type": "deep", "prompt": "x",
                                          "metadata": {"k": [[1, [2]], {"a": {"b": 1}}]}})
        assert ok.status_code == 201


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    # alice: 5 live agents and 2 queued requests at most; bob has no quota.
    engine = FakeEngine(kv_capacity_tokens=2048, max_model_len=1024)
    keys = {**{key: tenant for tenant, key in KEYS.items()}, "key-admin": "admin"}
    with FakeServer(tmp_path_factory.mktemp("quota"), engine=engine, api_keys=keys,
                    max_agents=None, tenant_max_agents={"alice": 5},
                    max_queued=None, tenant_max_queued={"alice": 2}) as srv:
        yield srv


def test_live_agent_quota_is_a_429_with_retry_after_and_frees_up(quota_server) -> None:
    with _as(quota_server, "alice") as alice, _as(quota_server, "bob") as bob:
        ids = [alice.post("/v1/agents", json={"type": "q", "prompt": "x"}).json()["id"]
               for _ in range(5)]
        over = alice.post("/v1/agents", json={"type": "q", "prompt": "x"})
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        assert "--max-agents" in over.json()["detail"]
        # Untagged requests are agents too.
        untagged = alice.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert untagged.status_code == 429
        assert untagged.json()["error"]["type"] == "rate_limit_error"  # OpenAI's shape there
        # Another tenant is not held back.
        assert bob.post("/v1/agents", json={"type": "q", "prompt": "x"}).status_code == 201
        alice.post(f"/v1/agents/{ids[0]}/finish")
        assert alice.post("/v1/agents", json={"type": "q", "prompt": "x"}).status_code == 201
        for i in ids[1:]:
            alice.delete(f"/v1/agents/{i}")


def test_queued_request_quota_is_a_429(quota_server) -> None:
    import threading

    with _as(quota_server, "alice") as alice:
        agent = alice.post("/v1/agents", json={"type": "q", "prompt": "x"}).json()["id"]
        tagged = {"X-Justitia-Agent": agent}
        # Hold admission, so that requests queue.
        results: list[int] = []

        def send() -> None:
            with _as(quota_server, "alice") as c:
                results.append(c.post("/v1/completions", headers=tagged,
                                      json={"prompt": "x", "max_tokens": 1}).status_code)

        admin = httpx.Client(base_url=quota_server.url, timeout=30,
                             headers={"Authorization": "Bearer key-admin"})
        assert admin.post("/v1/admin/pause").status_code == 200  # requests queue
        try:
            threads = [threading.Thread(target=send) for _ in range(2)]
            for t in threads:
                t.start()
            from tests.support.waiting import wait_until

            wait_until(lambda: alice.get(f"/v1/agents/{agent}").json()["requests_in_flight"] == 2,
                       10)
            over = alice.post("/v1/completions", headers=tagged,
                              json={"prompt": "x", "max_tokens": 1})
            assert over.status_code == 429 and "--max-queued" in over.json()["detail"]
        finally:
            admin.post("/v1/admin/resume")
            admin.close()
        for t in threads:
            t.join(20)
        assert results == [200, 200]
        alice.post(f"/v1/agents/{agent}/finish")


def test_agent_lists_and_history_come_in_pages(two_tenants) -> None:
    with _as(two_tenants, "bob") as bob:
        made = [bob.post("/v1/agents", json={"type": "paged", "prompt": f"p{i}"}).json()["id"]
                for i in range(7)]
        seen: list[str] = []
        cursor = None
        pages = 0
        while True:
            params = {"limit": 3, **({"cursor": cursor} if cursor else {})}
            body = bob.get("/v1/agents", params=params).json()
            assert len(body["agents"]) <= 3
            seen += [a["id"] for a in body["agents"]]
            pages += 1
            cursor = body["next_cursor"]
            if cursor is None:
                break
        assert [i for i in seen if i in made] == made and pages >= 3
        assert bob.get("/v1/agents", params={"limit": 1001}).status_code == 400
        assert bob.get("/v1/agents", params={"cursor": "x"}).status_code == 400
        for i in made[:4]:
            _finish_with_request(bob, i)
        first = bob.get("/v1/history", params={"agent_type": "paged", "limit": 3}).json()
        assert len(first["samples"]) == 3 and first["next_cursor"] is not None
        rest = bob.get("/v1/history", params={"agent_type": "paged", "limit": 3,
                                               "cursor": first["next_cursor"]}).json()
        assert len(rest["samples"]) == 1 and rest["next_cursor"] is None
        ids = [s["agent_id"] for s in first["samples"] + rest["samples"]]
        assert ids == made[:4]


def _finish_with_request(c: httpx.Client, agent_id: str) -> None:
    r = c.post("/v1/completions", headers={"X-Justitia-Agent": agent_id},
               json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200
    c.post(f"/v1/agents/{agent_id}/finish")


def test_slow_header_clients_cannot_starve_health_checks(tmp_path) -> None:
    """Connections that never finish their headers are closed after the header timeout
    (held forever, 20,000 of them make /healthz fail for tens of seconds), and health checks
    are answered meanwhile."""
    import socket
    import time

    with FakeServer(tmp_path, header_timeout_s=1.0) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        slow = []
        for _ in range(300):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            slow.append(s)
        latencies = []
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            for _ in range(20):
                started = time.monotonic()
                assert c.get("/healthz").status_code == 200
                latencies.append(time.monotonic() - started)
        assert max(latencies) < 0.5, latencies
        time.sleep(1.5)
        for s in slow:  # the server closed them: reading gives EOF
            s.settimeout(2)
            assert s.recv(100) == b""
            s.close()


def test_an_unreadable_history_is_moved_aside_and_the_server_starts(tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "history.sqlite3").write_bytes(b"this is not a database" * 500)
    with FakeServer(data) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/readyz").status_code == 200
        moved = list(data.glob("history.sqlite3.corrupt-*"))
        assert len(moved) == 1 and moved[0].read_bytes().startswith(b"this is not")
        rec = c.post("/v1/agents", json={"type": "t", "prompt": "x"}).json()
        _finish_with_request(c, rec["id"])
        assert c.get("/v1/history").json()["samples"][0]["agent_id"] == rec["id"]


def test_metadata_size_is_capped_and_prompts_are_not_kept_whole(two_tenants) -> None:
    with _as(two_tenants, "bob") as bob:
        big = {f"k{i}": i for i in range(20_000)}
        r = bob.post("/v1/agents", json={"type": "meta", "prompt": "x", "metadata": big})
        assert r.status_code == 413 and "--max-metadata-bytes" in r.text
        rec = bob.post("/v1/agents", json={"type": "meta", "prompt": "y" * 500_000}).json()
        _finish_with_request(bob, rec["id"])
        sample = bob.get("/v1/history", params={"agent_type": "meta"}).json()["samples"][-1]
        assert sample["agent_id"] == rec["id"] and len(sample["prompt"]) == 64 * 1024


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(two_tenants) -> None:
    import time

    with _as(two_tenants, "bob") as bob:
        started = time.monotonic()
        r = bob.post("/v1/completions", json={"prompt": "word " * 700_000, "max_tokens": 1})
        assert r.status_code == 400 and "cannot fit the model's context" in r.text
        assert time.monotonic() - started < 2.0
        ids = bob.post("/v1/completions", json={"prompt": [1] * 300_000, "max_tokens": 1})
        assert ids.status_code == 400 and "token ids" in ids.text


@pytest.mark.slow
def test_large_bodies_are_parsed_off_the_event_loop(two_tenants, monkeypatch) -> None:
    """A ~2 MB list of token ids, a 4 MB registration or finish would take the event loop
    1.4 s each on a loaded machine (no health check answered meanwhile): every
    body over OFF_LOOP_BYTES is parsed and validated in a worker thread, smaller ones on
    the loop; health checks are answered while they are."""
    import threading

    from server.api import validation
    from server.api.bodies import OFF_LOOP_BYTES

    loop_thread = f"fake-server-{two_tenants.url.rsplit(':', 1)[1]}"
    where: list[str] = []
    real = validation.find_invalid_value

    def spy(data: object) -> str | None:  # every body model runs this first
        where.append(threading.current_thread().name)
        return real(data)

    monkeypatch.setattr(validation, "find_invalid_value", spy)

    def parsed_on(send) -> str:
        where.clear()
        send()
        assert len(where) == 1, where
        return where[0]

    big_meta = {"notes": "n" * 40_000, "rows": ["r" * 1_000] * 300}  # ~340 KB of metadata
    with _as(two_tenants, "bob") as bob:
        rec = bob.post("/v1/agents", json={"type": "small", "prompt": "x"}).json()
        assert parsed_on(lambda: bob.post("/v1/agents", json={"type": "small", "prompt": "x"})) == loop_thread
        results: dict[str, httpx.Response] = {}
        cases = {
            "ids": lambda: results.__setitem__("ids", bob.post(
                "/v1/completions", json={"prompt": [1] * 200_000, "max_tokens": 1})),
            "register": lambda: results.__setitem__("register", bob.post(
                "/v1/agents", json={"type": "big", "prompt": "p" * OFF_LOOP_BYTES})),
            "metadata": lambda: results.__setitem__("metadata", bob.post(
                "/v1/agents", json={"type": "big", "prompt": "x", "metadata": big_meta})),
            "finish": lambda: results.__setitem__("finish", bob.post(
                f"/v1/agents/{rec['id']}/finish", json={"error": "e" * 100_000, "pad": "p" * OFF_LOOP_BYTES})),
        }
        for name, send in cases.items():
            assert parsed_on(send) != loop_thread, name
        assert results["ids"].status_code == 400 and "token ids" in results["ids"].text
        # a large registration is the same record as any other
        big = results["register"]
        assert big.status_code == 201, big.text[:300]
        again = bob.get(f"/v1/agents/{big.json()['id']}").json()
        assert again.keys() == big.json().keys()
        moving = {"eta_s", "fair_finish_s", "eta_interval_s"}  # estimates refreshed since
        assert {k: v for k, v in again.items() if k not in moving} == {
            k: v for k, v in big.json().items() if k not in moving}
        # over --max-metadata-bytes: refused without encoding it all, naming the limit
        over = results["metadata"]
        assert over.status_code == 413 and "at least" in over.text and "--max-metadata-bytes" in over.text
        assert results["finish"].status_code == 400  # an unknown field: nothing finished
        assert bob.get(f"/v1/agents/{rec['id']}").json()["state"] != "finished"

        # and health checks are answered while large bodies are parsed
        done = threading.Event()

        def big_bodies() -> None:
            with _as(two_tenants, "bob") as c:
                for _ in range(3):
                    c.post("/v1/completions", json={"prompt": [1] * 900_000, "max_tokens": 1})
            done.set()

        threading.Thread(target=big_bodies, daemon=True).start()
        answered = 0
        with httpx.Client(base_url=two_tenants.url, timeout=30) as c:
            while not done.is_set():
                assert c.get("/healthz").status_code == 200
                answered += 1
        assert answered >= 1


def test_a_small_body_over_the_metadata_limit_is_refused_with_its_exact_size(two_tenants) -> None:
    with _as(two_tenants, "alice") as alice:
        r = alice.post("/v1/agents", json={"type": "m", "prompt": "x", "metadata": {"k": "v" * 70_000}})
        assert r.status_code == 413 and "holds 70008 bytes" in r.text


def test_agent_bytes_quota_bounds_a_tenants_memory_and_frees_up(tmp_path) -> None:
    """--max-agents bounds a tenant's memory only by the count of its agents;
    --max-agent-bytes bounds the bytes of prompts and metadata they hold."""
    keys = {key: tenant for tenant, key in KEYS.items()}
    with FakeServer(tmp_path, api_keys=keys, max_agent_bytes=None,
                    tenant_max_agent_bytes={"alice": 100_000}) as srv:
        with _as(srv, "alice") as alice, _as(srv, "bob") as bob:
            big = {"type": "b", "prompt": "p" * 30_000, "metadata": {"notes": "n" * 10_000}}
            ids = [alice.post("/v1/agents", json=big).json()["id"] for _ in range(2)]  # 80 KB
            over = alice.post("/v1/agents", json=big)
            assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
            assert "--max-agent-bytes" in over.json()["detail"]
            small = alice.post("/v1/agents", json={"type": "b", "prompt": "x"})
            assert small.status_code == 201  # what fits still registers
            assert bob.post("/v1/agents", json=big).status_code == 201  # bob has no quota
            assert alice.delete(f"/v1/agents/{ids[0]}").status_code == 200
            assert alice.post("/v1/agents", json=big).status_code == 201  # freed by the end


def test_sizes_parse_with_binary_suffixes() -> None:
    from server.runtime.limits import parse_bytes

    assert parse_bytes("65536") == 65536 and parse_bytes("512K") == 512 * 1024
    assert parse_bytes("64M") == 64 << 20 and parse_bytes("1g") == 1 << 30 and parse_bytes("2MiB") == 2 << 20
    for bad in ("", "-1", "1.5M", "10T", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_serve_parses_agent_bytes_per_tenant() -> None:
    from justitia_cli import build_parser
    from server.cli.serve_checks import parse_limits

    args = build_parser().parse_args(["serve", "--max-agent-bytes", "64M", "--max-agent-bytes", "bob=off",
                                      "--max-agent-bytes", "alice=512K"])
    limits = parse_limits(args, {"alice", "bob"})
    assert limits["max_agent_bytes"] == 64 << 20
    assert limits["tenant_max_agent_bytes"] == {"alice": 512 << 10, "bob": None}


def _deadline_beside_a_flood(srv: FakeServer, split: bool, requests: int = 24) -> float:
    """alice's deadline, promised at registration, while bob has `requests` queued: on one
    agent, or untagged (a one-request agent each)."""
    import asyncio
    import threading

    from tests.support.waiting import wait_until

    admin = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": "Bearer key-admin"})
    bob_agent = None
    with _as(srv, "bob") as bob:
        if not split:
            bob_agent = bob.post("/v1/agents", json={"type": "flood", "prompt": "x"}).json()["id"]
    headers = {"Authorization": f"Bearer {KEYS['bob']}",
               **({"X-Justitia-Agent": bob_agent} if bob_agent else {})}

    async def flood() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers=headers,
                                     limits=httpx.Limits(max_connections=requests + 4)) as c:
            await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": "flood " * 60, "max_tokens": 60, "ignore_eos": True}) for _ in range(requests)))

    assert admin.post("/v1/admin/pause").status_code == 200
    sender = threading.Thread(target=lambda: asyncio.run(flood()), daemon=True)
    try:
        sender.start()
        wait_until(lambda: admin.get("/v1/scheduler").json()["pending_requests"] >= requests, 120)
        with _as(srv, "alice") as alice:
            rec = alice.post("/v1/agents", json={"type": "honest", "prompt": "q", "predicted_cost": 50_000.0,
                                                 "metadata": {"stages": 4}}).json()
            alice.delete(f"/v1/agents/{rec['id']}")
    finally:
        admin.post("/v1/admin/resume")
        sender.join(120)
        admin.close()
    if bob_agent is not None:
        with _as(srv, "bob") as bob:
            bob.post(f"/v1/agents/{bob_agent}/finish")
    return rec["deadline_s"]


@pytest.mark.timeout(300)
def test_a_tenant_splitting_its_work_does_not_widen_anothers_deadline(tmp_path) -> None:
    """Fair share is the tenant's before its agents': bob's 24 queued requests as 24
    untagged requests (24 agents) widen alice's promised deadline at most 1.5x against the
    same requests on one agent (a share per agent would widen it 3-6x)."""
    keys = {**KEYS, "admin": "key-admin"}
    with keyed_server(tmp_path, kv_tokens=2048, keys=keys) as srv:
        one = _deadline_beside_a_flood(srv, split=False)
        split = _deadline_beside_a_flood(srv, split=True)
    assert one > 0 and split <= 1.5 * one, (one, split)
