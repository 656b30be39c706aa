"""The blocking `Client` at parity with `AsyncClient`, and the retries in the transport.

The parity check fails when a public `AsyncClient` method (or property, or attribute) has
no twin on `Client` with the same parameters; it is shown to fail on a client that lacks one.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections.abc import Iterator

import anyio
import httpx
import pytest

from justitia_sdk import AsyncClient, Batch, Client, ServerUnavailableError, agent, llm
from justitia_sdk._sync import ASYNC_ONLY, RENAMED
from justitia_sdk._transport import RetryTransport
from server.launcher import free_port
from tests.support.fake_engine import FakeEngine, FakeServer
from tests.support.waiting import wait_until


def missing_twins(async_cls: type, sync_cls: type) -> list[str]:
    """Public members of `async_cls` without a twin of the same kind and parameters on
    `sync_cls` (`ASYNC_ONLY` and `RENAMED` say which have none, or another name)."""
    missing = []
    for name, member in inspect.getmembers(async_cls):
        if name.startswith("_") or name in ASYNC_ONLY:
            continue
        twin_name = RENAMED.get(name, name)
        twin = inspect.getattr_static(sync_cls, twin_name, None)
        if twin is None:
            missing.append(f"{name}: no {twin_name}")
        elif isinstance(inspect.getattr_static(async_cls, name), property):
            if not isinstance(twin, property):
                missing.append(f"{name}: a property, {twin_name} is not")
        elif callable(member):
            want = list(inspect.signature(member).parameters.values())[1:]
            have = list(inspect.signature(getattr(sync_cls, twin_name)).parameters.values())[1:]
            if want != have:
                missing.append(f"{name}{inspect.signature(member)} != "
                               f"{twin_name}{inspect.signature(getattr(sync_cls, twin_name))}")
    for name in ("__init__",):
        if inspect.signature(getattr(async_cls, name)) != inspect.signature(getattr(sync_cls, name)):
            missing.append(f"{name}: other parameters")
    return missing


def test_every_public_async_method_has_a_blocking_twin_with_its_parameters() -> None:
    assert missing_twins(AsyncClient, Client) == []
    # Public attributes set by the constructor are readable on the twin too.
    client = AsyncClient(f"http://127.0.0.1:{free_port()}")
    public = [name for name in vars(client) if not name.startswith("_")]
    assert "last_batch" in public and "base_url" in public
    assert [name for name in public if not hasattr(Client, name)] == []


def test_the_parity_check_finds_a_missing_or_different_twin() -> None:
    class Grown(AsyncClient):
        async def pause_agent(self, agent_id: str) -> None: ...

        async def get_agent(self, agent_id: str, *, fresh: bool = False) -> None:  # type: ignore[override]
            ...

    found = missing_twins(Grown, Client)
    assert any(f.startswith("pause_agent") for f in found)
    assert any(f.startswith("get_agent") for f in found)


def test_a_custom_transport_is_retried_and_its_errors_are_the_sdks() -> None:
    """Retries wrap whatever does the I/O: a refused connection over a transport given by
    the caller ends in `ServerUnavailableError` after the retries, not in an httpx error."""

    async def main() -> None:
        inner = httpx.AsyncHTTPTransport()
        async with AsyncClient(f"http://127.0.0.1:{free_port()}", transport=inner,
                               max_retries=2) as client:
            assert isinstance(client._http._transport, RetryTransport)
            with pytest.raises(ServerUnavailableError, match="through 2 retries"):
                await client.list_agents()

    anyio.run(main)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServer]:
    with FakeServer(tmp_path_factory.mktemp("sync"), engine=FakeEngine()) as srv:
        yield srv


@agent
async def echo_twice(text: str) -> str:
    return await llm(f"echo {text}", max_tokens=2) + await llm(f"again {text}", max_tokens=2)


def test_the_blocking_client_watches_leases_and_batches(server: FakeServer) -> None:
    with Client(server.url, server_gone_s=60) as client:
        assert client.server_gone_s == 60 and client.server_gone is False
        record = client.register_agent("leased", "text", lease_s=30)
        assert record.state in ("queued", "running")
        client.complete("hi", max_tokens=2, agent_id=record.id)
        client.finish_agent(record.id)
        states = [r.state for r in client.watch_agent(record.id)]
        assert states[-1] == "finished"
        # The multiplexed stream: leaving the loop early closes it.
        seen = []
        for r in client.watch_agents([record.id]):
            seen.append(r.id)
            break
        assert seen == [record.id]

        with client.batch(echo_twice, ["a", "b", "c"], progress=False, concurrency=2) as batch:
            assert isinstance(batch, Batch) and client.last_batch is batch
        assert batch.done and [h.status for h in batch] == ["finished"] * 3
        assert batch.concurrency == 2


def test_an_error_in_a_blocking_batch_block_cancels_its_runs(server: FakeServer) -> None:
    @agent
    async def slow(text: str) -> str:
        await anyio.sleep(30)
        return text

    with Client(server.url) as client:
        with pytest.raises(RuntimeError, match="stop"):
            with client.batch(slow, ["a", "b"], progress=False) as batch:
                wait_until(lambda: all(h.record is not None for h in batch), limit_s=20)
                raise RuntimeError("stop")
        assert [h.status for h in batch] == ["cancelled", "cancelled"]
        assert {client.get_agent(h.ids[0]).state for h in batch} == {"cancelled"}


# A script iterating a batch whose main thread spends its time in a garbage-collector
# callback when Ctrl-C comes: Python runs SIGINT's handler there and drops the
# KeyboardInterrupt it raises ("Exception ignored in: <function ...>").
_DROPPED_CTRL_C = """
import gc, json, os, signal, sys, threading, time
import anyio
from justitia_sdk import Client, agent

# Ctrl-C as a script started from a terminal has it: a test runner's worker may ignore
# SIGINT, and its children inherit that.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

@agent("sleeps")
async def sleeps(i: int) -> int:
    await anyio.sleep(float(sys.argv[2]))
    return i

armed = threading.Event()

def ctrl_c_inside_the_collector(phase, info):
    if phase == "start" and armed.is_set() and threading.current_thread() is threading.main_thread():
        armed.clear()
        signal.raise_signal(signal.SIGINT)
        until = time.monotonic() + 0.05
        while time.monotonic() < until:  # the handler runs here, between two bytecodes
            pass

with Client(sys.argv[1]) as client:
    started, outcome = time.monotonic(), "completed"
    try:
        with client.batch(sleeps, list(range(4)), progress=False) as batch:
            while sum(h.record is not None for h in batch) < 4:
                time.sleep(0.05)
            gc.set_threshold(1)  # a collection at nearly every allocation, in either thread
            gc.callbacks.append(ctrl_c_inside_the_collector)
            threading.Timer(1.0, armed.set).start()  # once the loop below waits
            for handle in client.as_completed(sleeps, [9], progress=False):
                pass
    except KeyboardInterrupt:
        outcome = "interrupted"
    finally:
        gc.callbacks.clear()
        gc.set_threshold(700)
    print(json.dumps({"outcome": outcome, "armed": armed.is_set(),
                      "took": time.monotonic() - started}), flush=True)
"""


def test_a_ctrl_c_python_drops_in_a_collector_callback_still_stops_a_blocking_wait(
        server: FakeServer, tmp_path) -> None:
    script = tmp_path / "dropped_ctrl_c.py"
    script.write_text(_DROPPED_CTRL_C)
    sleep_s = 20.0
    done = subprocess.run([sys.executable, str(script), server.url, str(sleep_s)],
                          capture_output=True, text=True, timeout=sleep_s + 15.0)
    found = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert found, done.stdout + done.stderr
    summary = json.loads(found[-1])
    # The Ctrl-C was raised inside the collector (so Python dropped its KeyboardInterrupt
    # there), and the wait raised it anyway: the batch did not run its 20 s to the end.
    assert not summary["armed"] and "Exception ignored" in done.stderr, done.stderr[-2000:]
    assert summary["outcome"] == "interrupted", done.stderr[-2000:]
    assert summary["took"] < sleep_s, summary
