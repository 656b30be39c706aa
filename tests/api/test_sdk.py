"""The SDK on the fake engine: its retries (503 while the engine is down, 429, refused
connections) and its in-process transport. The SDK's contract suites, on the fake engine and
on vLLM, are test_sdk_agents.py, test_sdk_batch.py and test_examples.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from justitia_sdk import AsyncClient, ServerUnavailableError, llm
from server.api.app import WARM_UP_BATCH, WARM_UP_ROUNDS
from server.runtime.limits import Rate
from tests.support.fake_engine import FAKE_MODEL, FakeEngine, FakeServer
from tests.support.waiting import wait_until

pytestmark = pytest.mark.anyio


# -- retries ---------------------------------------------------------------------------------


async def test_503_is_retried_until_the_engine_is_back(tmp_path) -> None:
    """While the engine is down the server answers 503; the SDK retries with backoff and
    the call succeeds once the engine is back, without the caller seeing the outage."""
    with FakeServer(tmp_path) as srv:
        srv.engine.kill()
        assert httpx.post(srv.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 2}).status_code == 503
        async with AsyncClient(srv.url, max_retries=6) as client:
            async with anyio.create_task_group() as tg:
                async def revive_soon() -> None:
                    await anyio.sleep(0.4)
                    await anyio.to_thread.run_sync(srv.engine.revive)

                tg.start_soon(revive_soon)
                started = time.monotonic()
                done = await client.complete("after the outage", max_tokens=3, ignore_eos=True)
        assert done.usage.completion_tokens == 3
        assert time.monotonic() - started >= 0.4  # it did wait for the engine


async def test_503_through_every_retry_is_server_unavailable(tmp_path) -> None:
    with FakeServer(tmp_path) as srv:
        srv.engine.kill()
        async with AsyncClient(srv.url, max_retries=2) as client:
            with pytest.raises(ServerUnavailableError, match="503") as info:
                await client.complete("x", max_tokens=2)
        assert "engine" in str(info.value) and "2 retries" in str(info.value)


async def test_429_through_every_retry_is_server_unavailable(tmp_path) -> None:
    with FakeServer(tmp_path, rate_limit=Rate(0.2, 1.0)) as srv:
        async with AsyncClient(srv.url, max_retries=0) as client:
            await client.register_agent("limited", "p")
            with pytest.raises(ServerUnavailableError, match="429"):
                await client.register_agent("limited", "p")


async def test_a_refused_connection_is_retried_until_the_server_is_up(tmp_path) -> None:
    """Connection refused is retried: a client started before its server gets through."""
    from server.launcher import free_port

    port = free_port()
    srv = FakeServer(tmp_path)
    async with AsyncClient(f"http://127.0.0.1:{port}", max_retries=8) as client:
        async with anyio.create_task_group() as tg:
            async def start_soon() -> None:
                await anyio.sleep(0.3)
                await anyio.to_thread.run_sync(lambda: srv.start(port=port))

            tg.start_soon(start_soon)
            models = await client.models()
    srv.stop()
    assert [m["id"] for m in models] == [FAKE_MODEL]


# -- in-process, without a socket ----------------------------------------------------------------


@asynccontextmanager
async def in_process(tmp_path) -> AsyncIterator[tuple[AsyncClient, FakeEngine]]:
    """The app on this event loop, its lifespan run as a server would, and an SDK client
    over httpx.ASGITransport (no socket, no thread)."""
    from server.api.app import create_app
    from server.api.config import ServerConfig

    engine = FakeEngine()
    app = create_app(ServerConfig(data_dir=str(tmp_path)), engine=engine,
                     model_name=engine.model)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://justitia.test", transport=transport) as client:
            yield client, engine


async def test_the_sdk_runs_agents_in_process_over_asgi(tmp_path) -> None:
    from justitia_sdk import agent, parallel_map

    @agent("in_process")
    async def two(text: str) -> list[int]:
        outs = await parallel_map(lambda n: llm(text, max_tokens=n, ignore_eos=True), [2, 5])
        return [len(o) for o in outs]

    async with in_process(tmp_path) as (client, engine):
        assert await client.run(two, "hi") == [2, 5]  # one character per fake token
        [record] = await client.list_agents()
        assert record.type == "in_process" and record.state == "finished"
        assert record.requests_done == 2
        # the warm-up batch, then the agent's two
        warm = [r for r in engine.requests if r.request_id.startswith("justitia-warmup")]
        assert len(warm) == WARM_UP_ROUNDS * len(WARM_UP_BATCH)
        assert [r.sampling.max_tokens for r in engine.requests[len(warm):]] == [2, 5]


# -- the fake server itself ----------------------------------------------------------------------


def test_fake_servers_stop_and_free_their_port(tmp_path) -> None:
    with FakeServer(tmp_path) as srv:
        url = srv.url
        assert httpx.get(url + "/healthz").status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/healthz")
    wait_until(lambda: not srv.engine.healthy, limit_s=5)  # the lifespan closed the engine


# -- a server that dies and comes back ------------------------------------------------------

_SERVE_FAKE = """
import os, sys, threading, time
from tests.support.fake_engine import FakeEngine, FakeServer

def exit_with_parent(parent=os.getppid()):  # a test process killed outright takes it along
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

threading.Thread(target=exit_with_parent, daemon=True).start()
srv = FakeServer(sys.argv[1], engine=FakeEngine(step_s=0.01)).start(port=int(sys.argv[2]))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


class _ServerProcesses:
    """The fake servers a test starts, each in a process of its own. The fixture kills every
    one at the test's end, whatever the end (a failure, a timeout); one that a thread of the
    test starts after that end is killed at once."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._ended = False
        self._lock = threading.Lock()

    def start(self, data_dir: Path, port: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _SERVE_FAKE, str(data_dir), str(port)],
                                stdout=subprocess.PIPE, text=True)
        with self._lock:
            self._procs.append(proc)
            ended = self._ended
        if ended:
            self._kill(proc)
            raise RuntimeError("the test has ended: its server is not started")
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    def kill_all(self) -> None:
        with self._lock:
            self._ended = True
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def server_processes() -> Iterator[_ServerProcesses]:
    procs = _ServerProcesses()
    try:
        yield procs
    finally:
        procs.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(120)  # two servers start from a fresh interpreter each: seconds apiece on a busy machine
async def test_an_agent_survives_its_server_being_killed_and_restarted(tmp_path, server_processes) -> None:
    """The request in flight when the server died is sent again once it is back (the
    server forgot the agent: the SDK registers it again), within the retry window."""
    from justitia_sdk import agent, llm
    from server.launcher import free_port

    port = free_port()
    proc = server_processes.start(tmp_path / "a", port)
    restarted: list = []

    @agent("survivor")
    async def survivor() -> str:
        first = await llm("one", max_tokens=3)
        return first + await llm("two", max_tokens=300, ignore_eos=True)

    def kill_and_restart() -> None:
        from tests.support.waiting import wait_until

        wait_until(lambda: any(a["requests_total"] == 2 for a in httpx.get(
            f"http://127.0.0.1:{port}/v1/agents").json()["agents"]), 20)
        proc.kill()  # kill -9: the connection of the second request breaks
        proc.wait(10)
        time.sleep(2.0)  # down for a while: refused connections meanwhile
        restarted.append(server_processes.start(tmp_path / "b", port))

    async with AsyncClient(f"http://127.0.0.1:{port}", retry_window_s=60) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, kill_and_restart)
            out = await client.run(survivor)
    assert len(out) > 0 and restarted
    agents = httpx.get(f"http://127.0.0.1:{port}/v1/agents").json()["agents"]
    assert [a["state"] for a in agents] == ["finished"]  # re-registered on the new server
