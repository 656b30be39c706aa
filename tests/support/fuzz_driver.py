"""Fuzzing the HTTP API from its own OpenAPI schema with schemathesis.

Shared by tests/api/test_input_regressions.py (a bounded run in the suite) and benchmarks/fuzz_api.py (a
larger campaign). For every operation, schemathesis generates inputs that fit the schema
(positive) and inputs that break it (negative: wrong types, missing fields, bad JSON, bad
or missing credentials...); each is sent to a real server and its answer is checked:

- no 5xx (`not_a_server_error`),
- the status, content type, headers and body are the ones the schema documents,
- calls need the key (`ignored_auth`: the same call without it must be refused),
- an answer within `timeout_s` (a request that gets none is recorded as a hang),
- no error event inside a streamed answer: once a stream has started its status is 200, so
  a failure after that point can only be seen in the events.

Every input is sent and checked, failing or not (the inner function never raises), so the
counts are what was really tried.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

# Pausing admission would stall every other request on the server (the fuzzer's own
# completions included); it is tested on its own in tests/api/test_tenancy.py.
# Pausing admission would stall the other operations' requests; the multiplexed event stream
# lasts as long as its client watches, by design (tests/engine/test_sdk_robustness.py covers it), and
# so does the dashboard's (tests/api/test_dashboard.py).
EXCLUDED = frozenset({"POST /v1/admin/pause", "GET /v1/agents/events", "GET /v1/scheduler/events"})

@schemathesis.check
def no_error_in_event_stream(ctx: Any, response: Any, case: Any) -> bool | None:
    """A streamed completion that failed mid-way says so in an `error` event (status 200)."""
    content_type = (response.headers.get("content-type") or [""])[0]
    if not content_type.startswith("text/event-stream"):
        return None
    for line in response.content.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            if isinstance(event, dict) and "error" in event:
                raise AssertionError(f"the stream reports an error: {line[:300]}")
    return True


CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "ignored_auth",
    "missing_required_header",
    "no_error_in_event_stream",
)
# Not checked, on purpose:
# - negative_data_rejection: unknown query parameters are ignored, as most HTTP APIs do, and
#   schemathesis counts a call with one as "schema-violating input accepted";
# - positive_data_acceptance: schema-valid input is refused for reasons no schema can say
#   (an agent id that does not exist: 404; a prompt over the context: 400);
# - use_after_free (stateful): DELETE cancels an agent; its record stays readable, with
#   state "cancelled", by design (DESIGN.md section 8).


@dataclass
class Tally:
    """What one operation (in one generation mode) was sent, and what went wrong."""

    label: str
    mode: str
    inputs: int = 0
    statuses: Counter = field(default_factory=Counter)
    slowest_s: float = 0.0
    # failure kind -> how many inputs hit it, and the first one (as a curl command)
    failures: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def fail(self, kind: str, example: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.examples.setdefault(kind, example)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["statuses"] = {str(k): v for k, v in sorted(self.statuses.items())}
        return d


def load_schema(base_url: str) -> schemathesis.BaseSchema:
    """The schema the server itself serves, so the run tests what is deployed."""
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


def operations(schema: schemathesis.BaseSchema) -> dict[str, Any]:
    """label ("POST /v1/completions") -> operation, without the excluded ones."""
    ops = (result.ok() for result in schema.get_all_operations())
    return {op.label: op for op in ops if op.label not in EXCLUDED}


def _checks() -> list:
    return [getattr(schemathesis.checks, name) for name in CHECKS]


def _send(case: Any, tally: Tally, headers: dict[str, str], timeout_s: float) -> None:
    tally.inputs += 1
    start = time.monotonic()
    try:
        response = case.call(headers=headers, timeout=timeout_s)
    except Exception as exc:  # no answer at all: a hang (timeout) or a dropped connection
        tally.fail(f"no answer within {timeout_s:g} s ({type(exc).__name__})",
                   case.as_curl_command(headers=headers))
        return
    tally.slowest_s = max(tally.slowest_s, time.monotonic() - start)
    tally.statuses[response.status_code] += 1
    try:
        case.validate_response(response, checks=_checks(), headers=headers,
                               transport_kwargs={"headers": headers, "timeout": timeout_s})
    except BaseExceptionGroup as group:  # schemathesis' FailureGroup: one per failed check
        for failure in group.exceptions:
            kind = f"{getattr(failure, 'code', '')} {getattr(failure, 'title', failure)}".strip()
            example = f"{case.as_curl_command(headers=headers)}\n-> {response.status_code} " \
                      f"{response.text[:300]}"
            tally.fail(kind, example)
    except AssertionError as failure:
        tally.fail(str(failure).splitlines()[0] if str(failure) else "check failed",
                   case.as_curl_command(headers=headers))


def fuzz_operation(operation: Any, *, headers: dict[str, str], examples: int,
                   timeout_s: float, seed: int, label: str | None = None,
                   fixed: dict[str, Any] | None = None) -> list[Tally]:
    """Up to `examples` positive and `examples` negative inputs for one operation, sent
    with `headers` (the key).

    `fixed` pins parts of every input (`{"path_parameters": {"agent_id": ...}}`,
    `{"headers": {...}}`: as_strategy's arguments); `label` names such a variant."""
    return [_fuzz_mode(operation, mode, Tally(label or operation.label, mode.value), examples=examples,
                       seed=seed, headers=headers, timeout_s=timeout_s, fixed=fixed)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]


def _fuzz_mode(operation: Any, mode: GenerationMode, tally: Tally, *, examples: int, seed: int,
               headers: dict[str, str], timeout_s: float, fixed: dict[str, Any] | None) -> Tally:
    """One generation mode of `fuzz_operation`, its cases counted in `tally` (a function of its
    own so that the hypothesis test binds this mode's tally, not the loop's last one)."""
    strategy = operation.as_strategy(generation_mode=mode, **(fixed or {}))

    # No shrinking: nothing raises here, and every input is sent once.
    @hypothesis.seed(seed)
    @hypothesis.settings(max_examples=examples, deadline=None, database=None,
                         phases=[Phase.generate],
                         suppress_health_check=list(HealthCheck))
    @hypothesis.given(case=strategy)
    def run(case: Any) -> None:
        _send(case, tally, headers, timeout_s)

    try:
        run()
    except Unsatisfiable:
        pass  # an operation with no parameters has no negative inputs
    return tally


def summarize(tallies: list[Tally]) -> dict[str, Any]:
    """Per operation: inputs tried, statuses, failures; and the totals."""
    by_op: dict[str, dict[str, Any]] = {}
    for t in tallies:
        op = by_op.setdefault(t.label, {"inputs": 0, "positive": 0, "negative": 0,
                                        "statuses": Counter(), "failures": {},
                                        "slowest_s": 0.0})
        op["inputs"] += t.inputs
        op[t.mode] += t.inputs
        op["statuses"].update(t.statuses)
        op["slowest_s"] = round(max(op["slowest_s"], t.slowest_s), 3)
        for kind, n in t.failures.items():
            op["failures"][kind] = op["failures"].get(kind, 0) + n
    for op in by_op.values():
        op["statuses"] = {str(k): v for k, v in sorted(op["statuses"].items())}
    return {
        "operations": by_op,
        "inputs": sum(t.inputs for t in tallies),
        "failures": sum(sum(t.failures.values()) for t in tallies),
        "server_errors": sum(n for t in tallies for s, n in t.statuses.items() if s >= 500),
        "slowest_s": round(max((t.slowest_s for t in tallies), default=0.0), 3),
    }
