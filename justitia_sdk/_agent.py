"""`@agent` and the LLM calls made inside agents.

An agent is an async function. Calling it *submits* it: the SDK registers the agent with the
server (type + the prompt text the cost predictor sees), runs the function with the agent's
id in a contextvar, and tells the server the agent is done when the function returns or
raises. If the run is cancelled (a sibling failed, the user pressed Ctrl-C), the agent is
cancelled on the server, which aborts its requests still in the engine.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import anyio

from justitia_sdk._api import APIClient, current_client
from justitia_sdk._context import AgentRun, current_run
from justitia_sdk._errors import JustitiaError
from justitia_sdk._models import AgentRecord, Completion
from justitia_sdk._names import check_agent_type

P = ParamSpec("P")
R = TypeVar("R")

# Every @agent by its type name (the last definition of a name wins), so that tools can
# find an agent by the name the server knows it by (`justitia train-predictor --inputs`).
_REGISTRY: dict[str, Agent[..., Any]] = {}

# Finishing or cancelling an agent must happen even while its task is being cancelled, but
# must not hang a shutdown if the server is gone.
_CLOSE_TIMEOUT_S = 15.0

# The metadata keys that declare an agent's structure to the server (docs/server.md): what
# `@agent(shape=...)` may return.
SHAPE_KEYS = frozenset({"stages", "critical_path_tokens", "prefill_tokens", "prefill_square_tokens",
                        "first_request_tokens", "stage_request_tokens"})


def default_prompt(*args: Any, **kwargs: Any) -> str:
    """The text of the str arguments, and of the strs inside lists, tuples and dicts."""
    parts: list[str] = []

    def walk(value: Any, depth: int = 0) -> None:
        if depth > 8:
            return
        if isinstance(value, str):
            if value:
                parts.append(value)
        elif isinstance(value, Mapping):
            for v in value.values():
                walk(v, depth + 1)
        elif isinstance(value, (list, tuple, set, frozenset)):
            for v in value:
                walk(v, depth + 1)

    for a in args:
        walk(a)
    for v in kwargs.values():
        walk(v)
    return "\n".join(parts)


class Agent(Generic[P, R]):
    """An async function that the server schedules as one agent. Made by `@agent`."""

    def __init__(
        self,
        fn: Callable[P, Awaitable[R]],
        *,
        name: str | None = None,
        prompt: Callable[..., str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        shape: Callable[..., Mapping[str, Any]] | None = None,
    ) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"@agent needs an async function; {fn!r} is not one")
        self.fn = fn
        # Checked here, where the agent is defined: the server refuses such a type only when
        # the agent first runs, perhaps deep inside a batch.
        self.name = check_agent_type(fn.__name__ if name is None else name)
        self.prompt_extractor = prompt
        self.shape_extractor = shape
        self.metadata = dict(metadata or {})
        functools.update_wrapper(self, fn)
        _REGISTRY[self.name] = self

    def __repr__(self) -> str:
        return f"<agent {self.name!r}>"

    def extract_prompt(self, *args: Any, **kwargs: Any) -> str:
        """The text the server's cost predictor sees for these arguments."""
        if self.prompt_extractor is not None:
            text = self.prompt_extractor(*args, **kwargs)
            if not isinstance(text, str):
                raise TypeError(f"the prompt extractor of {self.name!r} returned "
                                f"{type(text).__name__}, not str")
            return text
        return default_prompt(*args, **kwargs)

    def extract_shape(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The structure the agent declares for these arguments (metadata keys of
        `SHAPE_KEYS`; {} without a `shape` extractor)."""
        if self.shape_extractor is None:
            return {}
        shape = self.shape_extractor(*args, **kwargs)
        if not isinstance(shape, Mapping):
            raise TypeError(f"the shape extractor of {self.name!r} returned {type(shape).__name__}, not a mapping")
        if unknown := sorted(set(shape) - SHAPE_KEYS):
            raise TypeError(f"the shape extractor of {self.name!r} returned unknown key(s) {', '.join(unknown)}; "
                            f"the server reads {', '.join(sorted(SHAPE_KEYS))}")
        return dict(shape)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        return self.invoke(args, kwargs)

    async def invoke(
        self,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        client: APIClient | None = None,
        metadata: Mapping[str, Any] | None = None,
        on_start: Callable[[AgentRun], None] | None = None,
    ) -> R:
        """Submit one run: register, run the function under the agent's id, finish.

        `client` defaults to the ambient one (set by `client.run`, `submit_many`, an
        enclosing agent, or `client.as_default()`), else a client for `JUSTITIA_URL` made
        for this run. `on_start` sees the run once it is registered.
        """
        kwargs = dict(kwargs or {})
        client = client or current_client.get()
        if client is None:
            async with APIClient() as own:
                return await self.invoke(args, kwargs, client=own, metadata=metadata,
                                         on_start=on_start)
        prompt = self.extract_prompt(*args, **kwargs)
        meta = {**self.metadata, **self.extract_shape(*args, **kwargs), **(metadata or {})} or None
        record = await client.register_agent(self.name, prompt or self.name, meta)
        run = AgentRun(id=record.id, type=self.name, prompt=prompt, record=record, metadata=meta)
        if on_start is not None:
            on_start(run)
        run_token = current_run.set(run)
        client_token = current_client.set(client)
        try:
            result = await self.fn(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, (anyio.get_cancelled_exc_class(), KeyboardInterrupt, SystemExit)):
                await _close(client, run, cancel=True)
            else:
                # The run is incomplete: the server records it as failed, not as a
                # training sample of what this agent costs.
                await _close(client, run, error=_describe(exc))
            raise
        finally:
            current_client.reset(client_token)
            current_run.reset(run_token)
        await _close(client, run)
        return result


def get_agent(name: str) -> Agent[..., Any] | None:
    """The `@agent` registered under this type name in this process, if any."""
    return _REGISTRY.get(name)


def registered_agents() -> dict[str, Agent[..., Any]]:
    """Every `@agent` defined in this process, by type name."""
    return dict(_REGISTRY)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _close(client: APIClient, run: AgentRun, *, cancel: bool = False,
                 error: str | None = None) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT_S):
        try:
            if cancel:
                record = await client.cancel_agent(run.id)
            else:
                record = await client.finish_agent(run.id, error=error)
        except JustitiaError:
            # Already terminal (expired, cancelled by an operator) or the server is gone:
            # the run's outcome is the function's, not this bookkeeping call's.
            return
        run.record = record


@overload
def agent(fn: Callable[P, Awaitable[R]], /) -> Agent[P, R]: ...


@overload
def agent(
    name: str | None = None,
    /,
    *,
    prompt: Callable[..., str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    shape: Callable[..., Mapping[str, Any]] | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Agent[P, R]]: ...


def agent(
    fn_or_name: Any = None,
    /,
    *,
    name: str | None = None,
    prompt: Callable[..., str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    shape: Callable[..., Mapping[str, Any]] | None = None,
) -> Any:
    """Make an async function an agent.

    ```python
    @agent
    async def summarize(doc: str) -> str: ...

    @agent("fact_verification", prompt=lambda claim, evidence: claim)
    async def verify(claim: str, evidence: list[str]) -> bool: ...
    ```

    The name is the agent *type* (the server keeps one cost predictor per type); it defaults
    to the function's name. `prompt` extracts the text the cost predictor sees from the
    agent's arguments; by default it is the text of its str arguments and of the strs in
    its lists and dicts. `metadata` is sent with every registration. `shape` declares the
    agent's structure for these arguments, as metadata the server reads (`SHAPE_KEYS`:
    `stages`, `critical_path_tokens`, `stage_request_tokens`, ...; docs/server.md): its
    delay bound then covers its own critical path, and ETAs, its own and those of the agents
    behind it, the room its stages' largest requests wait for.
    """
    if callable(fn_or_name):
        return Agent(fn_or_name, name=name, prompt=prompt, metadata=metadata, shape=shape)
    type_name = fn_or_name if fn_or_name is not None else name

    def wrap(fn: Callable[P, Awaitable[R]]) -> Agent[P, R]:
        return Agent(fn, name=type_name, prompt=prompt, metadata=metadata, shape=shape)

    return wrap


async def _ambient_call(method: str, *args: Any, **kwargs: Any) -> Completion:
    client = current_client.get()
    if client is None:
        # Outside any agent and any client: a one-off, untagged request.
        async with APIClient() as own:
            completion: Completion = await getattr(own, method)(*args, **kwargs)
            return completion
    completion = await getattr(client, method)(*args, **kwargs)
    return completion


async def complete(prompt: str, *, max_tokens: int = 256, **sampling: Any) -> Completion:
    """A completion with its metadata (text, finish reason, token usage), tagged with the
    current agent. Sampling keywords: temperature, top_p, top_k, seed, stop, ignore_eos,
    min_tokens, model."""
    return await _ambient_call("complete", prompt, max_tokens=max_tokens, **sampling)


async def llm(prompt: str, *, max_tokens: int = 256, **sampling: Any) -> str:
    """The text of one completion of `prompt`, tagged with the current agent."""
    return (await complete(prompt, max_tokens=max_tokens, **sampling)).text


async def chat(
    messages: str | Sequence[Mapping[str, Any]],
    *,
    system: str | None = None,
    max_tokens: int = 256,
    **sampling: Any,
) -> str:
    """The reply to a chat (a list of {"role", "content"} messages, or one user message)."""
    completion = await _ambient_call("chat", messages, system=system, max_tokens=max_tokens,
                                     **sampling)
    return completion.text


def current_record() -> AgentRecord | None:
    """The record the server returned when the current agent was registered."""
    run = current_run.get()
    return run.record if run is not None else None
