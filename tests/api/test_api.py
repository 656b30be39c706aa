"""The HTTP layer on the fake engine alone: the OpenAI routes, a fresh server's promises,
faults and error answers, through real HTTP to the real app. The fake's outputs are exact (a
byte tokenizer, one token per step), so many answers are checked to the token; what holds on
any engine is in the contract suite (test_agents_api.py, run on the fake and on vLLM)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.support.agents import (
    RECORD_FIELDS,
    complete,
    core_views,
    promise_clauses,
    register,
)
from tests.support.clients import local_client
from tests.support.fake_engine import FAKE_MODEL, FakeEngine, FakeServer, encode
from tests.support.servers import ENGINE_MAX_MODEL_LEN
from tests.support.streams import BackgroundStream
from tests.support.waiting import all_agents, wait_until

# -- operations and the OpenAI routes ---------------------------------------------------------


def test_health_ready_and_models(fake_client: httpx.Client) -> None:
    assert fake_client.get("/healthz").json() == {"status": "ok"}
    assert fake_client.get("/readyz").json() == {"status": "ready", "model": FAKE_MODEL}
    data = fake_client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [FAKE_MODEL]
    assert data[0]["max_model_len"] == ENGINE_MAX_MODEL_LEN


@pytest.mark.parametrize("n", [1, 7, 40])
def test_completion_returns_exactly_max_tokens_with_ignore_eos(fake_client: httpx.Client,
                                                               n: int) -> None:
    r = fake_client.post("/v1/completions", json={"prompt": "Summarize: the river flows",
                                                  "max_tokens": n, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == FAKE_MODEL
    assert body["usage"] == {"prompt_tokens": len(encode("Summarize: the river flows")),
                             "completion_tokens": n,
                             "total_tokens": len(encode("Summarize: the river flows")) + n,
                             # what the engine served from its prefix cache (a fresh prompt: none)
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["text"]) == n  # one character per fake token


def test_prompt_tokens_come_from_the_engines_tokenizer(fake_client: httpx.Client) -> None:
    text = fake_client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 1}).json()
    assert text["usage"]["prompt_tokens"] == len(encode("a b"))
    ids = fake_client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2})
    assert ids.json()["usage"]["prompt_tokens"] == 4


def test_chat_completion_and_stop_strings(fake_client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hello"}]
    r = fake_client.post("/v1/chat/completions",
                         json={"messages": messages, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5
    # No chat template on the fake: the server renders the plain transcript.
    assert body["usage"]["prompt_tokens"] == len(encode("user: hello\nassistant:"))
    stopped = fake_client.post("/v1/chat/completions",
                               json={"messages": messages, "max_tokens": 200, "stop": ["fox"]})
    choice = stopped.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "fox" not in choice["message"]["content"]
    assert stopped.json()["usage"]["completion_tokens"] < 200


def test_streaming_gives_the_same_text_and_ends_with_usage_and_done(
        fake_client: httpx.Client) -> None:
    body = {"prompt": "stream me", "max_tokens": 25, "ignore_eos": True}
    whole = fake_client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    lines = []
    with fake_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 25
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


# -- error answers -------------------------------------------------------------------------------


def _assert_4xx(r: httpx.Response, status: int, *needles: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail
    for needle in needles:
        assert needle in detail, detail


def test_a_request_that_just_fits_the_context_is_served(fake_client: httpx.Client) -> None:
    long = fake_client.post("/v1/completions",
                            json={"prompt": "w" * ENGINE_MAX_MODEL_LEN, "max_tokens": 4})
    _assert_4xx(long, 400, "maximum context length", str(ENGINE_MAX_MODEL_LEN))
    fits = fake_client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": ENGINE_MAX_MODEL_LEN - len(encode("hi")), "stop": ["e"]})
    assert fits.status_code == 200, fits.text


# -- the agent API -----------------------------------------------------------------------------


def test_the_first_agent_of_a_fresh_server_has_a_widened_promise(tmp_path) -> None:
    # A server of its own: on the shared one, the other tests' agents are arrivals, and the
    # deadline stretches the GPS finish by their share (checked in test_scheduler_promises).
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=30.0) as fake_client:
        rec = register(fake_client, prompt="verify: the river flows through three countries",
                       metadata={"source": "test"})
        assert RECORD_FIELDS <= rec.keys()
        assert rec["state"] == "queued" and rec["metadata"] == {"source": "test"}
        assert rec["predicted_cost"] > 0 and rec["virtual_finish"] > 0
        assert rec["fair_finish_s"] > 0 and rec["eta_s"] > 0 and rec["delay_bound_s"] > 0
        # the deadline was promised at registration: the first agent this server sees, so no
        # arrivals are measured yet and its worst case assumes the most load it allows for (90%
        # of the rate), and says so; nor is the engine's rate measured, and its cost is a
        # guess: its ETA rests on guesses, so the deadline is that worst case, not a multiple
        # of the ETA (which would rest on nothing)
        assert rec["deadline_s"] >= rec["fair_finish_s"] + rec["delay_bound_s"] - 1e-6
        assert rec["deadline_s"] >= rec["eta_s"]
        assert rec["promise_assumes"] == ""
        assert rec["promise"] == "widened" and "no arrivals measured yet" in rec["promise_reason"]
        assert rec["finished_at"] is None
        assert fake_client.get(f"/v1/agents/{rec['id']}").json()["id"] == rec["id"]
        assert rec["id"] in {a["id"] for a in all_agents(fake_client)}
        assert fake_client.delete(f"/v1/agents/{rec['id']}").json()["state"] == "cancelled"


def test_a_profile_measured_on_the_engine_is_the_time_models_prior_and_sets_the_eta_rate(tmp_path) -> None:
    """`serve --profile FILE` (what `bench live --profile FILE` passes): the time model starts
    from the calibration, and ETAs divide by the rate its engine sustains on the requests
    seen. Without it the built-in prior, measured on another host, times critical paths but
    does not set that rate until the fit has seen TRUSTED_STEPS steps."""
    from dataclasses import replace

    from server.shared.profiles import get_profile
    from server.sim.calibrate import save_profile

    path = tmp_path / "measured.json"
    save_profile(replace(get_profile("cpu-tiny"), name="measured-here", per_kv_token_s=4e-7), path)
    for profile in (str(path), None):
        with FakeServer(tmp_path / f"data-{profile is None}", profile=profile) as srv, \
                local_client(base_url=srv.url, timeout=20) as c:
            # a request seen (500 prompt tokens, 100 out): a mix to sustain
            assert complete(c, None, 100, prompt="x" * 499).status_code == 200
            snap = c.get("/v1/scheduler").json()
        prior = snap["time_model"]["prior"]
        if profile is None:
            assert prior["source"] == "prior: cpu-tiny profile" and prior["per_kv_token_s"] == 0.0
            assert snap["eta_rate"] == pytest.approx(snap["rate"])
        else:
            assert prior["source"] == "prior: measured-here profile" and prior["per_kv_token_s"] == 4e-7
            # the server's 10 ms guess is slower than the profile's engine on such requests
            # (about 5.5 ms for a full cache of them)
            assert snap["eta_rate"] > 1.5 * snap["rate"]


def test_a_profile_of_a_faster_host_is_scaled_to_the_engines_warm_up(tmp_path) -> None:
    """A profile whose steps are five times shorter than the engine's (calibrated on another
    host) is checked against the warm-up's last round, before any agent is promised
    anything: the prior that times ETAs is scaled to the engine, and the snapshot says by
    how much. A profile of this engine's speed is kept as it is; without one nothing is
    checked."""
    from dataclasses import replace

    from server.shared.profiles import get_profile
    from server.sim.calibrate import save_profile

    engine = get_profile("cpu-tiny")  # the fake engine steps as this profile says
    fast = replace(engine, name="elsewhere", base_s=engine.base_s / 5, per_seq_s=engine.per_seq_s / 5,
                   per_prefill_token_s=engine.per_prefill_token_s / 5)
    checks = {}
    for name, profile in (("elsewhere", fast), ("here", engine), ("none", None)):
        path = None
        if profile is not None:
            path = tmp_path / f"{name}.json"
            save_profile(profile, path)
        # (the fake's steps are sleeps the event loop overshoots: its own profile reads 1.2x)
        with FakeServer(tmp_path / f"data-{name}", profile=str(path) if path else None,
                        prior_tolerance=2.0) as srv, local_client(base_url=srv.url, timeout=20) as c:
            time_model = c.get("/v1/scheduler").json()["time_model"]
            e = register(c, type_="t", predicted_cost=1e4)
            assert e["eta_s"] > 0
        checks[name] = (time_model["prior_check"], time_model["prior"])
    check, prior = checks["elsewhere"]
    assert check["scaled"] and check["steps"] >= 16 and 3 < check["ratio"] < 8
    assert prior["base_s"] == pytest.approx(fast.base_s * check["ratio"])
    assert prior["source"].startswith("prior: elsewhere profile, scaled x")
    check, prior = checks["here"]
    assert not check["scaled"] and check["steps"] >= 16 and prior["base_s"] == engine.base_s
    assert checks["none"][0] is None  # the built-in prior is not trusted anyway: nothing to check


def test_a_declared_shape_of_long_prompts_is_told_their_chunked_prefill(tmp_path) -> None:
    """A calibration that measured the chunked prefill of prompts past the engine's step
    budget (`bench calibrate`'s `per_chunked_prefill_s`) is the time model's prior, term
    included; an agent that declares the squares of its prompts (`prefill_square_tokens`)
    is told the time their chunks add, one that does not is told its linear prefill."""
    from dataclasses import replace

    from server.shared.profiles import get_profile
    from server.sim.calibrate import save_profile

    profile = replace(get_profile("cpu-tiny"), name="chunked-here", prefill_chunk_tokens=2048,
                      per_chunked_prefill_s=1e-8)
    path = tmp_path / "chunked.json"
    save_profile(profile, path)
    prompts = [4000, 4000, 4000]
    shape = {"stages": 1, "critical_path_tokens": 20, "prefill_tokens": sum(prompts)}
    with FakeServer(tmp_path / "data", profile=str(path)) as srv, \
            local_client(base_url=srv.url, timeout=20) as c:
        prior = c.get("/v1/scheduler").json()["time_model"]["prior"]
        told = {}
        for square in (None, sum(p * p for p in prompts)):
            metadata = shape if square is None else {**shape, "prefill_square_tokens": square}
            rec = register(c, type_="long_prompts", predicted_cost=1e3, metadata=metadata)
            told[square is not None] = rec["eta_s"]
            assert c.delete(f"/v1/agents/{rec['id']}").status_code == 200
    assert (prior["prefill_chunk_tokens"], prior["per_chunked_prefill_s"]) == (2048, 1e-8)
    extra = sum(profile.chunked_prefill_s(p) for p in prompts)
    assert told[True] - told[False] == pytest.approx(extra, rel=0.1)


def test_eta_and_bound_equal_the_cores_on_a_fresh_server(tmp_path) -> None:
    """As test_agents_api.py's contract, on a server of its own (no other test's agents in
    the backlog or the arrivals), so the promises and their reasons are the core's exactly."""
    costs = [4e5, 1.5e6, 1e5, 8e5]
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=20) as c:
        # a request seen: the limits are the observed ones, not the context length's
        assert complete(c, None, 2).status_code == 200
        primer = register(c, type_="eta_primer", predicted_cost=max(costs))
        c.delete(f"/v1/agents/{primer['id']}")
        wait_until(lambda: c.get("/v1/scheduler").json()["backlog"] == 0, limit_s=20)
        assert c.post("/v1/admin/pause").json() == {"paused": True}
        recs = [register(c, type_=f"eta_agent{i}", predicted_cost=cost)
                for i, cost in enumerate(costs)]
        after = c.get("/v1/scheduler").json()
    for rec, view in zip(recs, core_views(after, recs, costs), strict=True):
        # agents without a request are not in the GPS reference: each is projected alone
        for key in ("fair_finish_s", "delay_bound_s"):
            assert rec[key] == pytest.approx(getattr(view, key), rel=0.02, abs=0.01), key
        assert rec["promise"] == view.promise
        assert promise_clauses(rec["promise_reason"]) == promise_clauses(view.promise_reason)
        # ETAs and deadlines also count the work the server saw arrive (measured off the
        # request path): the calibrated deadline never less than the core's without it, or
        # the worst case where that is the tighter (never before the fair finish plus the bound)
        assert rec["deadline_s"] >= min(view.deadline_s, rec["fair_finish_s"] + rec["delay_bound_s"]) - 0.01
        assert rec["eta_s"] > 0
    assert recs[2]["fair_finish_s"] < recs[0]["fair_finish_s"]


def test_in_process_engine_has_no_replicas(fake_client: httpx.Client) -> None:
    r = fake_client.get("/v1/admin/replicas")
    assert r.status_code == 409 and "--engine-url" in r.json()["detail"]


# -- faults ----------------------------------------------------------------------------------------


def test_engine_death_fails_requests_cleanly(tmp_path) -> None:
    """The fake engine dies under a streaming request: the stream ends with an error naming
    the engine, health and readiness turn 503, new requests get a 503 at once."""
    with FakeServer(tmp_path, engine=FakeEngine(step_s=0.005)) as srv, \
            local_client(base_url=srv.url, timeout=20) as c:
        stream = BackgroundStream(lambda: c.stream(
            "POST", "/v1/completions",
            json={"prompt": [5] * 10, "max_tokens": 2000, "ignore_eos": True, "stream": True}))
        wait_until(lambda: stream.events, limit_s=20)
        srv.engine.kill()
        stream.join(20)
        assert "error" in stream.events[-1] and "engine" in stream.events[-1]["error"]["message"]
        assert c.get("/healthz").status_code == 503
        assert c.get("/readyz").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "after", "max_tokens": 4})
        assert r.status_code == 503 and "engine" in r.json()["detail"]
        srv.engine.revive()
        assert c.get("/healthz").status_code == 200
        assert c.post("/v1/completions", json={"prompt": "back", "max_tokens": 4}).status_code == 200


def test_queued_requests_fail_when_the_engine_dies(tmp_path) -> None:
    """Requests waiting for admission are failed by housekeeping (503), not left hanging."""
    with FakeServer(tmp_path) as srv, local_client(base_url=srv.url, timeout=20) as c:
        rec = register(c)
        assert c.post("/v1/admin/pause").status_code == 200
        results: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: results.append(complete(c, rec["id"], 4)))
        worker.start()
        wait_until(lambda: c.get("/v1/scheduler").json()["pending_requests"] == 1, limit_s=20)
        srv.engine.kill()
        worker.join(20)
        assert results and results[0].status_code == 503, results
        assert "engine" in results[0].json()["detail"]


# -- an OpenAI-style tool history ------------------------------------------------------------

TOOL_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
]


def test_a_tool_history_is_accepted_and_rendered(fake_client: httpx.Client) -> None:
    """An agent that calls its own tools sends OpenAI's tool history back: an assistant
    message with `content: null` and `tool_calls`, then the `role: "tool"` answer. It failed
    with `messages.1.content: Input should be a valid string`."""
    r = fake_client.post("/v1/chat/completions",
                         json={"messages": TOOL_HISTORY, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    # No chat template on the fake: the transcript carries the call and its answer.
    transcript = ("user: What is the weather in Paris?\n"
                  "assistant (tool call call_1): get_weather({\"city\": \"Paris\"})\n"
                  "tool (call_1): 18 C, clear\nassistant:")
    assert r.json()["usage"]["prompt_tokens"] == len(encode(transcript))
    # content as a list of text parts, as OpenAI allows, is the same text
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} if m["content"] else m
             for m in TOOL_HISTORY]
    same = fake_client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 3})
    assert same.status_code == 200, same.text
    assert same.json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_a_malformed_tool_history_and_auto_without_a_parser_are_clear_400s(
        fake_client: httpx.Client) -> None:
    post = fake_client.post
    no_id = [TOOL_HISTORY[0], TOOL_HISTORY[1], {"role": "tool", "content": "18 C"}]
    _assert_4xx(post("/v1/chat/completions", json={"messages": no_id}), 400, "tool_call_id")
    empty = [{"role": "user", "content": None}]
    _assert_4xx(post("/v1/chat/completions", json={"messages": empty}), 400,
                "user message needs content")
    calls_from_user = [{"role": "user", "content": "x", "tool_calls": TOOL_HISTORY[1]["tool_calls"]}]
    _assert_4xx(post("/v1/chat/completions", json={"messages": calls_from_user}), 400,
                "only an assistant message may have tool_calls")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    refused = post("/v1/chat/completions", json={"messages": TOOL_HISTORY, "tools": tools})
    _assert_4xx(refused, 400, "tool_choice", "auto", "--tool-call-parser")
    assert refused.json()["error"]["param"] == "tool_choice"


@pytest.mark.slow
@pytest.mark.timeout(300)  # importing transformers takes a while on a busy 2-core host
def test_a_tool_history_reaches_the_models_chat_template(tmp_path) -> None:
    """With a model whose chat template knows tools, the history is rendered by it, as vLLM's
    server renders it: the call's JSON arguments as an object, the answer's tool_call_id."""
    from transformers import AutoTokenizer

    from server.api.openai_schemas import ChatCompletionRequest
    from server.engine.tiny_model import init_tiny
    from server.engine.tokens import TokenizerEngine
    from server.runtime.service import render_chat

    model = init_tiny(tmp_path / "m")
    template = ("{% for m in messages %}<{{ m.role }}>"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.id }} "
                "{{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
                "{% else %}{{ m.content }}{% endif %}"
                "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}</{{ m.role }}>"
                "{% endfor %}<assistant>")
    engine = TokenizerEngine()
    engine._tokenizer = AutoTokenizer.from_pretrained(str(model))
    engine._tokenizer.chat_template = template
    body = ChatCompletionRequest.model_validate({"messages": TOOL_HISTORY})
    rendered = render_chat([m.for_template() for m in body.messages], engine)
    assert rendered == ('<user>What is the weather in Paris?</user>'
                        '<assistant>CALL call_1 get_weather {"city": "Paris"}</assistant>'
                        '<tool>18 C, clear FOR call_1</tool><assistant>')
