"""Parts of the SDK that need no server: the batch table, input splitting, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from justitia_sdk import AgentRecord, Batch, agent
from justitia_sdk._handle import AgentHandle, split_input
from justitia_sdk._render import batch_table, to_html


@agent("unit_agent")
async def unit_agent(text: str) -> str:
    return text


def record(state: str, **kw) -> AgentRecord:
    base = dict(id="agt-1", type="unit_agent", state=state, submitted_at=100.0,
                fair_finish_s=2.0, eta_s=2.5, delay_bound_s=1.0, first_eta_s=2.2)
    return AgentRecord.model_validate({**base, **kw})


def handle(i: int, rec: AgentRecord | None, *, done: bool = False,
           error: BaseException | None = None) -> AgentHandle:
    h = AgentHandle(i, unit_agent, f"input {i}")
    h.record = h.first_record = rec
    h.done, h.error = done, error
    return h


def test_split_input() -> None:
    assert split_input({"a": 1}) == ((), {"a": 1})
    assert split_input((1, 2)) == ((1, 2), {})
    assert split_input([1, 2]) == (([1, 2],), {})


def test_promises_and_summary() -> None:
    on_time = handle(0, record("finished", finished_at=102.5), done=True)
    late = handle(1, record("finished", finished_at=104.0), done=True)
    failed = handle(2, record("finished", finished_at=100.5), done=True, error=ValueError("x"))
    cancelled = handle(3, record("cancelled", finished_at=101.0), done=True)
    waiting = handle(4, None)
    batch = Batch([on_time, late, failed, cancelled, waiting], "units")
    assert on_time.jct_s == 2.5 and on_time.deadline_s == 3.0 and on_time.kept_promise is True
    assert late.kept_promise is False
    assert failed.status == "failed" and failed.kept_promise is None
    assert cancelled.kept_promise is None and waiting.status == "pending"
    assert on_time.first_eta_s == 2.2
    assert batch.mean_jct_s() == (2.5 + 4.0) / 2  # failed and cancelled runs left out
    assert batch.results(return_exceptions=True)[2].args == ("x",)
    text = to_html(batch_table(batch))
    for word in ("units", "JCT", "1st ETA", "1st deadline", "kept", "pending", "failed"):
        assert word in text


def test_live_table_shows_unfinished_runs_first_when_long() -> None:
    handles = [handle(i, record("finished", finished_at=101.0), done=True) for i in range(8)]
    handles.append(handle(8, record("running")))
    table = batch_table(Batch(handles, "long"), live=True, max_rows=3)
    assert table.row_count == 3
    assert "6 more not shown" in str(table.caption)
    assert "running" in to_html(table)


@pytest.mark.slow
def test_the_command_line_does_not_import_the_sdk_stack() -> None:
    code = ("import sys; from justitia_cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('httpx', 'rich', 'justitia_sdk._client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "justitia_sdk._client" not in out.stdout


@pytest.mark.slow
def test_the_sdk_imports_nothing_of_the_server_or_the_predictors() -> None:
    """The SDK talks HTTP only: importing every one of its modules, and every name it exports
    (its lazy attributes), loads no `server` or `predictors` module."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import justitia_sdk\n"
        "names = [m.name for m in pkgutil.walk_packages(justitia_sdk.__path__, 'justitia_sdk.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "for name in justitia_sdk.__all__: getattr(justitia_sdk, name)\n"
        "print(len(names), sorted(m for m in sys.modules\n"
        "      if m.split('.')[0] in ('server', 'predictors', 'justitia_cli')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, _, loaded = out.stdout.strip().partition(" ")
    assert int(count) >= 10  # the walk found the SDK's modules (guards against a vacuous pass)
    assert loaded == "[]"


def test_the_sdk_source_imports_nothing_of_the_server_not_even_lazily() -> None:
    """No import statement anywhere in the SDK (also inside functions) names `server`,
    `predictors` or the command line's host."""
    import ast
    from pathlib import Path

    import justitia_sdk

    found = []
    for path in sorted(Path(justitia_sdk.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {m}" for m in modules
                      if m.split(".")[0] in ("server", "predictors", "justitia_cli")]
    assert found == []



def test_a_promise_is_the_deadline_given_at_submission() -> None:
    """A deadline the server moved later since (a late start, an over-run) is not the promise
    the user was shown: `kept_promise` counts the first record's."""
    h = handle(0, record("finished", finished_at=105.0, deadline_s=9.0), done=True)
    h.first_record = record("queued", deadline_s=3.0)
    assert h.jct_s == 5.0 and h.deadline_s == 9.0 and h.first_deadline_s == 3.0
    assert h.kept_promise is False


def test_what_a_retry_can_change() -> None:
    """`is_retryable`: connection trouble, 408/429/5xx and the agent's own exceptions may
    go differently on a retry; a 4xx about the input, a gone server, a cancellation not."""
    import asyncio

    import httpx

    from justitia_sdk import APIError, ServerGoneError, ServerUnavailableError, is_retryable
    from justitia_sdk._errors import AgentCancelledError, AgentTimeoutError, error_for

    for status in (400, 401, 404, 409, 413, 422):
        assert not is_retryable(error_for(status, "about the input")), status
    for status in (408, 429, 500, 502, 503, 504):
        assert is_retryable(APIError(status, "busy")), status
    assert is_retryable(ValueError("the agent's own bug"))
    assert is_retryable(ServerUnavailableError("refused"))
    assert is_retryable(httpx.ConnectError("refused"))
    assert is_retryable(AgentTimeoutError("slow"))
    assert not is_retryable(ServerGoneError("gone"))
    assert not is_retryable(AgentCancelledError("cancelled"))
    assert not is_retryable(KeyboardInterrupt())
    assert not is_retryable(asyncio.CancelledError())

    class OpenAIStyle(Exception):  # another client's error that carries a status code
        status_code = 400

    assert not is_retryable(OpenAIStyle("prompt too long"))
    assert not is_retryable(ExceptionGroup("g", [ValueError(), OpenAIStyle()]))


def test_the_batch_eta_fills_free_slots_with_the_mean_jct() -> None:
    """Two inputs finished in 4 s each, two run with 3 s and 5 s to go, three wait, two
    slots: the waiting ones start at 3, 5 and 7 s and take 4 s each, so the batch ends at
    11 s."""
    import time

    finished = [handle(i, record("finished", finished_at=104.0), done=True) for i in range(2)]
    running = []
    for i, eta in ((2, 3.0), (3, 5.0)):
        h = handle(i, record("running", eta_s=eta))
        h.registered_at = time.time()
        running.append(h)
    waiting = [handle(i, None) for i in range(4, 7)]
    batch = Batch([*finished, *running, *waiting], "eta")
    batch.concurrency = 2
    eta = batch.eta_s()
    assert eta is not None and 10.5 < eta <= 11.0
    stats = batch.stats()
    assert (stats.finished, stats.running, stats.pending) == (2, 2, 3)
    assert stats.eta_s is not None and 10.5 < stats.eta_s <= 11.0
    assert "batch done in ~11 s" in batch.summary() or "batch done in ~10 s" in batch.summary()
    # nothing known yet: no estimate
    assert Batch([handle(0, None)], "unknown").eta_s() is None


def test_eta_error_and_promises_in_the_stats() -> None:
    on_time = handle(0, record("finished", finished_at=102.5), done=True)  # JCT 2.5, ETA 2.2
    late = handle(1, record("finished", finished_at=104.0), done=True)  # JCT 4, ETA 2.2
    stats = Batch([on_time, late], "errors").stats()
    assert (stats.judged, stats.kept) == (2, 1)
    errors = sorted([abs(2.2 - 2.5) / 2.5, abs(2.2 - 4.0) / 4.0])
    assert stats.eta_error_median == sum(errors) / 2 and stats.eta_error_p90 == errors[1]


def test_the_clients_take_the_api_clients_options_and_show_its_parameters() -> None:
    """`AsyncClient` and `Client` pass `ClientOptions` on to `APIClient`: the typed options
    are its keyword parameters, and both show its signature."""
    import inspect

    from justitia_sdk import AsyncClient, Client
    from justitia_sdk._api import APIClient, ClientOptions

    own = inspect.signature(APIClient.__init__)
    assert set(ClientOptions.__annotations__) == {
        name for name, p in own.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert inspect.signature(AsyncClient.__init__) == own == inspect.signature(Client.__init__)


def test_a_completion_body_carries_the_fields_set_and_any_other_as_given() -> None:
    """Sampling fields left None are the server's defaults (not sent); a stop tuple is a
    list; a field `Sampling` does not name goes as it is, None included."""
    import json

    import anyio
    import httpx

    from justitia_sdk import AsyncClient

    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        choice = {"text": "ok", "message": {"content": "ok"}, "finish_reason": "stop"}
        return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": {}})

    async def main() -> None:
        async with AsyncClient("http://test", transport=httpx.MockTransport(answer)) as client:
            await client.complete("hi", max_tokens=5, temperature=None, stop=("a", "b"), user=None)
            await client.chat("hi", system="be brief", seed=3)

    anyio.run(main)
    assert bodies[0] == {"prompt": "hi", "max_tokens": 5, "stop": ["a", "b"], "user": None}
    assert bodies[1] == {"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}],
                         "max_tokens": 256, "seed": 3}


def test_parallel_calls_of_an_agent_its_server_forgot_all_go_to_its_new_id() -> None:
    """Two parallel calls of one agent both answered 404 by a restarted server: the first
    registers the agent again, and the second, answered after that, resends to the new id
    instead of failing the agent (a 200-agent batch across a scheduler kill lost 62)."""
    import json

    import anyio
    import httpx

    from justitia_sdk import AsyncClient, agent, llm, parallel_map

    ids = iter(["a1", "a2"])
    in_flight_on_a1: list[httpx.Request] = []
    both_sent, registered_again = anyio.Event(), anyio.Event()
    served: list[str] = []

    def record(agent_id: str) -> dict:
        return {"id": agent_id, "type": "twin", "state": "running", "submitted_at": 0.0}

    async def answer(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/agents":
            agent_id = next(ids)
            if agent_id == "a2":
                registered_again.set()
            return httpx.Response(200, json=record(agent_id))
        if path.startswith("/v1/agents/"):
            return httpx.Response(200, json={**record(path.split("/")[3]), "state": "finished"})
        tag = request.headers["X-Justitia-Agent"]
        if tag == "a1":  # the server restarted: it knows no a1
            in_flight_on_a1.append(request)
            if len(in_flight_on_a1) == 2:
                both_sent.set()
            await both_sent.wait()
            if request is in_flight_on_a1[1]:
                await registered_again.wait()  # answered once the first call registered again
            return httpx.Response(404, json={"error": {"message": "agent a1 not found"}})
        served.append(json.loads(request.content)["prompt"])
        choice = {"text": "ok", "finish_reason": "stop"}
        return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": {}})

    @agent("twin")
    async def twin(x: int) -> list[str]:
        return await parallel_map(lambda k: llm(f"part {k}", max_tokens=4), range(2))

    async def main() -> list[str]:
        async with AsyncClient("http://test", transport=httpx.MockTransport(answer)) as client:
            with anyio.fail_after(10):
                return await client.run(twin, 1)

    assert anyio.run(main) == ["ok", "ok"]
    assert sorted(served) == ["part 0", "part 1"]  # each sent again, to a2
