"""Plausible mistakes get errors that say what to do (no server needed)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from justitia_sdk import AsyncClient, Client, NotJustitiaError, agent

pytestmark = pytest.mark.anyio


@agent("mistakes_agent")
async def named(text: str) -> str:
    return text


async def not_an_agent(text: str) -> str:
    return text


class _Html(http.server.BaseHTTPRequestHandler):
    def _page(self) -> None:
        body = b"<html><body><h1>Another web server</h1></body></html>"
        self.send_response(200 if self.path == "/v1/agents" else 404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _page

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def html_server() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("inputs", ["tree_of_thought", b"bytes", {"text": "a"}])
async def test_inputs_must_be_a_list_not_a_string_or_dict(inputs) -> None:
    async with AsyncClient("http://127.0.0.1:9") as client:
        with pytest.raises(TypeError, match="inputs must be"):
            await client.submit_many(named, inputs)


async def test_a_string_agent_names_a_registered_agent_or_says_which_exist() -> None:
    from justitia_sdk._runner import make_batch

    batch = make_batch("mistakes_agent", ["a", "b"])
    assert [h.agent for h in batch] == [named, named]
    with pytest.raises(ValueError, match="no @agent named 'tree_of_thought'.*mistakes_agent"):
        make_batch("tree_of_thought", ["a"])
    with pytest.raises(ValueError, match="2 agents for 3 inputs"):
        make_batch([named, named], ["a", "b", "c"])


async def test_run_on_an_undecorated_function_says_to_decorate_it() -> None:
    async with AsyncClient("http://127.0.0.1:9") as client:
        with pytest.raises(TypeError, match="decorate the async function with @agent"):
            await client.run(not_an_agent, "x")
        with pytest.raises(TypeError, match="@agent"):
            await client.submit_many(not_an_agent, ["x"])


async def test_a_url_serving_another_web_server_is_named_as_such(html_server: str) -> None:
    async with AsyncClient(html_server, max_retries=0) as client:
        with pytest.raises(NotJustitiaError, match="text/html, not Justitia's JSON"):
            await client.list_agents()
        with pytest.raises(NotJustitiaError, match="is JUSTITIA_URL"):
            await client.register_agent("t", "p")


def test_sync_client_checks_inputs_before_starting() -> None:
    with Client("http://127.0.0.1:9") as client:
        with pytest.raises(TypeError, match="inputs must be"):
            client.submit_many(named, "abc")
        with pytest.raises(TypeError, match="inputs must be"):
            list(client.as_completed(named, "abc"))


async def test_the_client_pool_is_bounded_and_the_transport_obeys_it() -> None:
    from justitia_sdk._api import MAX_CONNECTIONS

    async with AsyncClient("http://127.0.0.1:9", max_connections=7) as client:
        # httpx-aiohttp's transport keeps its own pool limit (100 unless told): it must get ours.
        assert client._http._transport.inner.limits.max_connections == 7
    assert MAX_CONNECTIONS <= 1000  # under a notebook's usual open-files limit
