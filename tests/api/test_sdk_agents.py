"""The SDK against the real server and engine: agents, tagging, parallel_map, cancellation."""

from __future__ import annotations

import anyio
import pytest

from justitia_sdk import (
    AgentClosedError,
    AgentNotFoundError,
    APIError,
    AsyncClient,
    Client,
    ServerUnavailableError,
    agent,
    chat,
    complete,
    current_agent_id,
    current_record,
    default_prompt,
    llm,
    parallel_map,
    run_sync,
    tool,
)

pytestmark = pytest.mark.anyio

# Long enough that a request is certainly still decoding when its sibling fails.
LONG = 900


class Boom(Exception):
    pass


async def wait_for(predicate, every_s: float = 0.05):
    # A bound on polling only, not an assertion on timing.
    with anyio.fail_after(120):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(every_s)


def test_default_prompt_takes_strs_from_args_lists_and_dicts() -> None:
    text = default_prompt("claim", 3, ["a", 4, {"k": "b"}], opts={"x": "c", "n": 1.5})
    assert text.split("\n") == ["claim", "a", "b", "c"]


def test_prompt_extractor_and_name() -> None:
    @agent("verifier", prompt=lambda claim, evidence: claim.upper())
    async def verify(claim: str, evidence: list[str]) -> bool:
        return True

    assert verify.name == "verifier"
    assert verify.extract_prompt("the sky", ["blue"]) == "THE SKY"

    @agent
    async def plain(x: str) -> str:
        return x

    assert plain.name == "plain"
    with pytest.raises(TypeError):
        agent(lambda x: x)


def test_a_shape_extractor_declares_the_structure_of_each_run() -> None:
    @agent("verifier", shape=lambda claim, evidence: {"stages": 2, "stage_request_tokens": [8 * len(evidence), 64]})
    async def verify(claim: str, evidence: list[str]) -> bool:
        return True

    assert verify.extract_shape("the sky", ["blue", "grey"]) == {"stages": 2, "stage_request_tokens": [16, 64]}

    @agent
    async def plain(x: str) -> str:
        return x

    assert plain.extract_shape("x") == {}
    # a key the server does not read, or no mapping at all: said where the run is submitted
    with pytest.raises(TypeError, match="unknown key.*stage_tokens"):
        agent("typo", shape=lambda x: {"stage_tokens": [1]})(plain.fn).extract_shape("x")
    with pytest.raises(TypeError, match="not a mapping"):
        agent("bad", shape=lambda x: [1])(plain.fn).extract_shape("x")  # type: ignore[arg-type, return-value]


async def test_a_declared_shape_reaches_the_server_and_a_bad_one_is_refused(server) -> None:
    @agent("shaped", shape=lambda n: {"stages": 2, "stage_request_tokens": [40] * n})
    async def shaped(n: int) -> dict:
        record = current_record()
        assert record is not None
        return record.metadata

    async with AsyncClient(server.url) as client:
        assert await client.run(shaped, 2) == {"stages": 2, "stage_request_tokens": [40, 40]}
        with pytest.raises(APIError) as refused:  # three entries for two stages
            await client.run(shaped, 3)
    assert refused.value.status_code == 400 and "stage_request_tokens has 3 entries" in str(refused.value)


def test_an_invalid_agent_name_is_refused_where_the_agent_is_defined() -> None:
    """The server refuses such a type (`400: type: String should match pattern ...`), but
    only when the agent first ran, perhaps deep inside a batch."""
    from justitia_sdk import AGENT_TYPE_PATTERN
    from server.api.agents_api import AgentCreate

    for bad in ("research assistant", "résumé", "a/b", "", "x" * 201):
        with pytest.raises(ValueError, match="invalid agent type name"):
            @agent(bad)
            async def fn(x: str) -> str:
                return x
        with pytest.raises(ValueError):
            AgentCreate(type=bad)  # the server's own rule agrees
    async def body(x: str) -> str:
        return x

    for good in ("research_assistant", "chat:6-turn", "v1.2", "x" * 200):
        assert agent(good)(body).name == good
        assert AgentCreate(type=good).type == good
    # one rule: the server's schema uses the SDK's constant
    assert AgentCreate.model_json_schema()["properties"]["type"]["pattern"] == AGENT_TYPE_PATTERN


async def test_run_sync_keeps_the_event_loop_running_during_a_blocking_tool() -> None:
    """A blocking call made directly in an async agent stops the event loop; through
    run_sync it runs in a thread while other tasks (here: the one it waits for) go on."""
    import threading

    released = threading.Event()

    def blocking_tool(q: str) -> str:
        # waits for a task on the event loop: it can only return if the loop keeps running
        return q.upper() if released.wait(timeout=30) else "the loop was blocked"

    async def release_soon() -> None:
        await anyio.sleep(0)
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_soon)
        assert await run_sync(blocking_tool, "query") == "QUERY"


async def test_requests_carry_the_agent_id_through_helpers_and_parallel_map(server) -> None:
    async def helper(text: str) -> tuple[str | None, str | None]:
        c = await complete(text, max_tokens=4, ignore_eos=True)
        return current_agent_id(), c.agent_id

    @agent
    async def fan_out(items: list[str]) -> tuple[str | None, list]:
        ids = await parallel_map(helper, items)
        await chat([{"role": "user", "content": "and now?"}], max_tokens=4)
        await llm("final", max_tokens=4)
        return current_agent_id(), ids

    async with AsyncClient(server.url) as client:
        own_id, ids = await client.run(fan_out, ["one", "two", "three"])
        assert own_id is not None and current_agent_id() is None
        assert ids == [(own_id, own_id)] * 3
        record = await client.get_agent(own_id)
    assert record.type == "fan_out"
    assert record.state == "finished"
    assert (record.requests_total, record.requests_done) == (5, 5)
    assert record.jct_s is not None and record.jct_s >= 0


async def test_concurrent_agents_do_not_share_ids(server) -> None:
    @agent
    async def worker(n: int) -> str | None:
        await parallel_map(lambda i: llm(f"item {i}", max_tokens=2), range(n))
        return current_agent_id()

    async with AsyncClient(server.url) as client:
        with client.as_default():
            ids = await parallel_map(worker, [1, 2, 3])
        records = [await client.get_agent(i) for i in ids]
    assert len(set(ids)) == 3
    assert [r.requests_total for r in records] == [1, 2, 3]


async def test_failure_cancels_siblings_and_aborts_their_engine_requests(server) -> None:
    async with AsyncClient(server.url) as client:
        seen: list[str] = []

        async def branch(i: int) -> str:
            if i == 0:
                aid = current_agent_id()
                assert aid is not None
                seen.append(aid)
                # Fail only once the two long siblings are in the server's hands.
                await wait_for(lambda: _has_requests(client, aid, 2))
                raise Boom("branch 0")
            return await llm("go " * 4, max_tokens=LONG, ignore_eos=True)

        @agent
        async def fragile() -> list[str]:
            return await parallel_map(branch, range(3))

        with pytest.raises(Boom):  # the error itself, not an exception group
            await client.run(fragile)
        record = await client.get_agent(seen[0])
        # An incomplete run: failed with its error, never a training sample.
        assert record.state == "failed" and record.error == "Boom: branch 0"
        # Both siblings were aborted long before producing LONG tokens each.
        full = 2 * (LONG * LONG / 2)
        await wait_for(lambda: _idle(client))
        record = await client.get_agent(seen[0])
        assert record.consumed_cost < full / 2


async def test_cancelling_an_agent_cancels_it_on_the_server(server) -> None:
    async with AsyncClient(server.url) as client:
        ids: list[str] = []

        @agent
        async def long_one() -> None:
            ids.append(current_agent_id() or "")
            await parallel_map(lambda i: llm("keep on writing", max_tokens=LONG, ignore_eos=True), range(2))

        async with anyio.create_task_group() as tg:
            tg.start_soon(client.run, long_one)
            await wait_for(lambda: _has_requests(client, ids[0], 2) if ids else _false())
            tg.cancel_scope.cancel()
        record = await client.get_agent(ids[0])
        assert record.state == "cancelled"
        await wait_for(lambda: _idle(client))


async def test_closed_and_unknown_agents_are_refused(server) -> None:
    async with AsyncClient(server.url) as client:
        rec = await client.register_agent("probe", "some text", {"purpose": "test"})
        assert rec.state == "queued" and rec.metadata == {"purpose": "test"}
        done = await client.finish_agent(rec.id)
        assert done.state == "finished"
        with pytest.raises(AgentClosedError) as closed:
            await client.complete("late", max_tokens=2, agent_id=rec.id)
        assert closed.value.status_code == 409
        with pytest.raises(AgentNotFoundError):
            await client.complete("who?", max_tokens=2, agent_id="agt-does-not-exist")
        with pytest.raises(AgentNotFoundError):
            await client.get_agent("agt-does-not-exist")
        assert rec.id in {r.id for r in await client.list_agents()}


async def test_watch_agent_streams_until_terminal(server) -> None:
    async with AsyncClient(server.url) as client:
        rec = await client.register_agent("watched", "text")
        states: list[str] = []

        async def watch() -> None:
            async for r in client.watch_agent(rec.id):
                states.append(r.state)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await client.complete("hi", max_tokens=2, agent_id=rec.id)
            await client.finish_agent(rec.id)
    assert states[-1] == "finished"


async def test_unreachable_server_is_reported_after_retries() -> None:
    from server.launcher import free_port

    async with AsyncClient(f"http://127.0.0.1:{free_port()}", max_retries=1) as client:
        with pytest.raises(ServerUnavailableError):
            await client.list_agents()


def test_sync_client(server) -> None:
    @agent
    async def twice(text: str) -> list[str]:
        return await parallel_map(lambda t: llm(f"echo {t} back", max_tokens=3), [text, text])

    with Client(server.url) as client:
        out = client.run(twice, "hello")
        assert len(out) == 2
        batch = client.submit_many(twice, ["a", "b"], progress=False)
        assert batch.done and [h.status for h in batch] == ["finished", "finished"]
        assert client.complete("say something short", max_tokens=2).usage.completion_tokens <= 2


async def _has_requests(client: AsyncClient, agent_id: str, n: int) -> bool:
    return (await client.get_agent(agent_id)).requests_total >= n


async def _idle(client: AsyncClient) -> bool:
    snap = await client.scheduler()
    return snap["running_requests"] == 0 and snap["pending_requests"] == 0


async def _false() -> bool:
    return False


async def test_a_tool_call_wrapped_by_the_sdk_reaches_the_server(server) -> None:
    """`tool()` announces the call's start (name, expected length) and its end, as a context
    manager and as a decorator; outside an agent it does nothing."""
    seen: list = []

    @tool("fetch")
    async def fetch(client: AsyncClient) -> None:
        seen.append(await client.get_agent(current_agent_id() or ""))

    @agent
    async def researcher(client: AsyncClient) -> str | None:
        await llm("look it up", max_tokens=2)
        async with tool("search", expected_s=12.0):
            seen.append(await client.get_agent(current_agent_id() or ""))
        seen.append(await client.get_agent(current_agent_id() or ""))
        await fetch(client)
        return current_agent_id()

    async with AsyncClient(server.url) as client:
        async with tool("outside"):  # no agent: nothing to tell, nothing fails
            pass
        await client.run(researcher, client)
    inside, after, decorated = seen
    assert inside.state == "paused" and inside.tool == "search"
    assert 0.0 < inside.pause_remaining_s <= 12.0
    assert after.tool is None
    assert decorated.tool == "fetch"
